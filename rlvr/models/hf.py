"""Hugging Face causal LMs behind the policy surface of ``TinyTransformer`` (optional extra).

This module gathers the public names of the modules that hold one job each:

- ``rlvr.models.lean_llama``: the lean Llama forward, its ``LeanCache``, rotary tables and the
  checks of which models can take it;
- ``rlvr.models.hf_policy``: ``HFPolicy`` (forward, caches, accounting, save) and ``HFCache``;
- ``rlvr.models.hf_tokenizer``: ``HFTokenizer``;
- ``rlvr.models.hf_load``: ``load_policy`` (+ LoRA), ``export_hf``, ``LoraSpec``;
- ``rlvr.models.hf_source``: where a model comes from (a directory, a ``.gguf``, ``pkg:NAME``), the
  cached safetensors copy of a GGUF, ``HFLoadError``.

``transformers`` / ``peft`` are imported inside the functions, so ``import rlvr.models.hf`` is
cheap and the core library never needs them.

Loading (everything local; nothing is downloaded)::

    policy, tok = load_policy("path/to/model", dtype="bf16", lora=LoraSpec(r=8, alpha=16))
    if policy.load_note: print(policy.load_note)        # e.g. "pad_token was unset: using eos ..."

``HFPolicy`` has the surface ``rlvr.sampling`` uses: ``forward(ids, *, attention_mask,
positions, cache, logits_to_keep) -> float32 logits``, ``new_cache(batch_size, max_len)``,
``config.block_size``, ``num_params()``, ``flops_per_token()``, ``save_pretrained()``. So
``sampling.generate`` and ``scoring.sequence_token_logprobs`` work unchanged, and the logp
stored at sampling time equals the trainer's recomputation (to float rounding; tested at 1e-5).
In bf16 the cached decode and the one-shot forward round differently (measured |Δlogp| up to
~2e-3 on a tiny Llama), so the first-pass ratio is 1 only to ~0.2%; a bf16 trainer that wants it
exact should recompute ``logp_old`` with one no-grad forward instead of using ``Rollout.logp``.

Lean Llama forward: a plain ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` or
``Qwen3ForCausalLM`` (also under a peft LoRA wrapper; static RoPE, no attention dropout; with a
sliding window, on sequences no longer than it) runs through ``rlvr.models.lean_llama.lean_forward`` (same logits to float rounding,
several times less per-call overhead on small models). ``HFPolicy(..., fast=False)`` /
``load_policy(..., fast=False)`` or ``policy.fast_path = False`` force the transformers forward; ``policy.fast_unsupported`` says why a
model cannot take the lean one (None = it can).

Conventions, the same as ``TinyTransformer``:

- Prompts are LEFT-padded; ``attention_mask`` (B, L) is 1 on real tokens. ``position_ids`` are
  ``cumsum(attention_mask) - 1`` clamped at 0 (offset by the cache's next positions when
  decoding), so a padded prompt gives the logits of the unpadded prompt.
- Every dropout of the wrapped model is set to 0 at load time (the rollout and the training
  forward must compute the same function; ``model.train()`` would otherwise change logp). The
  LoRA dropout of ``LoraSpec.dropout`` is kept as asked; anything > 0 makes the first-pass ratio
  differ from 1 in train mode, so the default is 0.

Reference policy with LoRA: the base model with the adapter switched off, no
second copy::

    with torch.no_grad(), policy.adapter_disabled():
        logp_ref = scoring.sequence_token_logprobs(policy, rollout, temperature=T, top_p=1.0, top_k=0, min_p=0.0)

The reference is then always the *initial* model; a "refresh the reference" schedule has no
meaning (``ref.load_state_dict(model.state_dict())`` must be skipped for LoRA policies).

Export: ``export_hf(policy, tok, out_dir)`` writes a plain HF directory
(``model.safetensors``, ``config.json``, tokenizer files) that ``AutoModelForCausalLM`` /
``AutoTokenizer.from_pretrained(out_dir)`` load without rlvr or peft. With LoRA the adapter is
merged into a copy of the model (the live model keeps its adapter) and the adapter alone is also
written to ``out_dir/adapter/`` (a PEFT directory whose ``base_model_name_or_path`` is the loaded
base); ``load_policy(base, adapter=out_dir/"adapter")`` resumes training from it.
"""

from __future__ import annotations

from rlvr.models.hf_load import DTYPES, LoraSpec, export_hf, load_policy
from rlvr.models.hf_policy import HFCache, HFPolicy
from rlvr.models.hf_source import PKG_PREFIX, TOKENIZER_FILES, HFLoadError, packaged_gguf
from rlvr.models.hf_tokenizer import HFTokenizer
from rlvr.models.lean_llama import LeanCache

__all__ = ["DTYPES", "TOKENIZER_FILES", "HFCache", "HFLoadError", "HFPolicy", "HFTokenizer", "LeanCache",
           "LoraSpec", "PKG_PREFIX", "export_hf", "load_policy", "packaged_gguf"]
