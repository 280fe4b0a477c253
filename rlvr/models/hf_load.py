"""Loading a local Hugging Face model as an ``HFPolicy`` (+ LoRA), and exporting it back.

Loading (everything local; nothing is downloaded)::

    policy, tok = load_policy("path/to/model", dtype="bf16", lora=LoraSpec(r=8, alpha=16))
    if policy.load_note: print(policy.load_note)        # e.g. "pad_token was unset: using eos ..."

Export: ``export_hf(policy, tok, out_dir)`` writes a plain HF directory (``model.safetensors``,
``config.json``, tokenizer files) that ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``
load without rlvr or peft. With LoRA the adapter is merged into a copy of the model and the adapter
alone is also written to ``out_dir/adapter/``. ``transformers`` / ``peft`` are imported inside the
functions only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from rlvr.models.hf_policy import HFPolicy
from rlvr.models.hf_source import no_progress_bars
from rlvr.models.hf_source import HFLoadError, LoraTargetsError, check_dir, resolve_model_dir
from rlvr.models.hf_tokenizer import HFTokenizer

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}

@dataclass
class LoraSpec:
    """LoRA adapter settings (peft ``LoraConfig``): only the adapter weights are trained."""

    r: int = 8
    """Rank of the update B @ A."""
    alpha: float = 16.0
    """Scale: the update is (alpha / r) * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapter input. Keep 0 for RL: > 0 makes train-mode logp differ from the rollout's."""
    target_modules: list[str] | str | None = None
    """Module names to adapt (e.g. ["q_proj", "v_proj"], or "all-linear"); None = peft's default for the model type."""

    def __post_init__(self):
        if not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoraSpec.r must be a positive int, got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoraSpec.alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSpec.dropout must be in [0, 1), got {self.dropout!r}")


def _zero_dropout(model: nn.Module) -> None:
    """p = 0 on every nn.Dropout and every float ``*dropout*`` attribute (e.g. Llama's attention_dropout)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name, v in list(vars(m).items()):
            if "dropout" in name and isinstance(v, float) and not isinstance(v, bool):
                setattr(m, name, 0.0)


# ---------------------------------------------------------------------- loading
def load_policy(path: str | Path, *, dtype: str | torch.dtype = "fp32", lora: LoraSpec | None = None,
                adapter: str | Path | None = None, device: str | torch.device = "cpu",
                attn_implementation: str | None = "sdpa", fast: bool = True,
                log: Callable[[str], None] | None = None) -> tuple[HFPolicy, HFTokenizer]:
    """Load ``AutoModelForCausalLM`` + ``AutoTokenizer`` from the local directory ``path``.

    ``path`` may also name a GGUF (a ``.gguf`` file, a directory holding one, or ``pkg:NAME``; see
    ``rlvr.models.hf_source``): it is converted once to a cached safetensors directory, which is
    what gets loaded (``policy.source``); ``log`` hears of a conversion before it starts.

    ``dtype`` "fp32" or "bf16" (the weights; logits are always returned as float32). ``lora``
    wraps the model in a fresh peft LoRA adapter (only its weights are trainable); ``adapter``
    instead loads a saved trainable adapter directory (``out_dir/adapter`` of ``export_hf``),
    to resume. Without either, every weight is trainable.

    A tokenizer without a pad token gets pad = eos (or a new ``<pad>`` token, embeddings resized,
    when there is no eos either); what was done is in ``policy.load_note`` (empty if nothing) for
    the caller to print. ``fast`` (default True) runs a plain ``LlamaForCausalLM`` (or Mistral,
    Qwen 2, Qwen 3; LoRA or not) through the lean forward of ``HFPolicy`` (same numbers, a fraction
    of transformers' per-call overhead); ``fast=False``, or any other model, uses the transformers
    forward (see ``HFPolicy.fast_unsupported``). Raises ``HFLoadError`` (a ``ValueError``) naming the path when the
    directory, its safetensors weights, or its tokenizer files are missing, or when a LoRA adapter
    would wrap a weight the model ties (input embedding = output head).
    """
    torch_dtype = _torch_dtype(dtype)
    p, source_note = resolve_model_dir(path, log)
    check_dir(p)
    if lora is not None and adapter is not None:
        raise ValueError("give lora= (a new adapter) or adapter= (a saved one), not both")
    if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
        raise HFLoadError(f"{adapter}: no adapter_config.json; not a PEFT adapter directory")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        hf_tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the path
        raise HFLoadError(f"{p}: cannot load the tokenizer: {type(e).__name__}: {e}") from e
    kw = dict(dtype=torch_dtype, local_files_only=True, use_safetensors=True)
    attn_note = ""
    if attn_implementation == "sdpa" and not _supports_sdpa(p):
        attn_implementation = "eager"
        attn_note = (f"{p}: transformers has no SDPA attention for this architecture; using its eager "
                     "attention (the attention weights are materialized: slower and more memory on long sequences)")
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation
    try:
        with no_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(str(p), **kw)
    except Exception as e:  # noqa: BLE001
        raise HFLoadError(f"{p}: cannot load the model: {type(e).__name__}: {e}") from e

    notes = [n for n in (source_note, attn_note) if n] + _fix_pad(hf_tok, model, p)
    _zero_dropout(model)
    if lora is not None or adapter is not None:
        model = _with_adapter(model, lora, adapter, p)
    model = model.to(device)
    model.eval()
    return HFPolicy(model, source=str(p), load_note="\n".join(notes), fast=fast), HFTokenizer(hf_tok)


def _supports_sdpa(p: Path) -> bool:
    """Whether the causal-LM class transformers maps the config in ``p`` to has SDPA attention (most do;
    Gemma 2 does not, and refuses to load with it). True when the class is not known here."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(str(p), local_files_only=True))]
    except (KeyError, ValueError, OSError):
        return True
    return getattr(cls, "_supports_sdpa", True) is not False


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if not isinstance(dtype, str):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _fix_pad(hf_tok, model: nn.Module, p: Path) -> list[str]:
    """Give the tokenizer a pad token (eos, else a new ``<pad>`` with the embeddings resized); check
    the model embeds every token. Returns the notes for ``policy.load_note``."""
    notes = []
    if hf_tok.pad_token is None:
        if hf_tok.eos_token is not None:
            hf_tok.pad_token = hf_tok.eos_token
            notes.append(f"{p}: tokenizer has no pad token; using eos {hf_tok.eos_token!r} "
                         f"(id {hf_tok.eos_token_id}) as pad (pads are masked out, so this is safe)")
        else:
            hf_tok.add_special_tokens({"pad_token": "<pad>"})
            model.resize_token_embeddings(len(hf_tok))
            notes.append(f"{p}: tokenizer has neither pad nor eos; added a '<pad>' token "
                         f"(id {hf_tok.pad_token_id}) and resized the embeddings to {len(hf_tok)}")
    if hf_tok.eos_token_id is None:
        notes.append(f"{p}: tokenizer has no eos token; responses always run to max_new_tokens")
    n_emb = model.get_input_embeddings().weight.shape[0]
    if len(hf_tok) > n_emb:
        raise HFLoadError(f"{p}: tokenizer has {len(hf_tok)} tokens but the model embeds only {n_emb}")
    if model.generation_config is not None and getattr(model.generation_config, "pad_token_id", None) is None:
        model.generation_config.pad_token_id = hf_tok.pad_token_id
    return notes


def tied_weight(model: nn.Module) -> torch.Tensor | None:
    """The weight a model's input embedding and output head share (``tie_word_embeddings``), else None.

    Tied weights are one parameter: the optimizer updates it once, ``num_params`` counts it once,
    and ``save_pretrained`` writes it once (transformers re-ties on load from ``config.json``)."""
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is None or out is None or getattr(out, "weight", None) is None:
        return None
    return inp.weight if out.weight is inp.weight else None


def _check_default_targets(model: nn.Module, lora: LoraSpec, p: Path) -> None:
    """Refuse a LoRA spec without target modules for a model type peft has no default targets for
    (Phi-3's fused qkv_proj, for one), naming the model's Linear layers to choose from."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

    kind = getattr(model.config, "model_type", None)
    if lora.target_modules is not None or kind in defaults:
        return
    head = model.get_output_embeddings()
    names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                    if isinstance(m, nn.Linear) and m is not head})
    raise LoraTargetsError(f"{p}: peft has no default LoRA target modules for model type {kind!r}; name some "
                           f"of this model's Linear layers ({', '.join(names)}) or ask for \"all-linear\"")


def _with_adapter(model: nn.Module, lora: LoraSpec | None, adapter, p: Path) -> nn.Module:
    """``model`` under a fresh peft LoRA adapter (``lora``) or a saved trainable one (``adapter``).

    Refuses an adapter on a tied weight: merging it would change the input embedding with the head
    (the exported logits would no longer be the trained policy's)."""
    import peft

    tied = tied_weight(model)
    if lora is not None:
        _check_default_targets(model, lora, p)
        cfg = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                              target_modules=lora.target_modules, bias="none", task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, cfg)
    else:
        with no_progress_bars():
            model = peft.PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    if tied is not None:
        on_tied = [name for name, m in model.named_modules()
                   if hasattr(m, "get_base_layer") and getattr(m.get_base_layer(), "weight", None) is tied]
        if on_tied:
            short = sorted({n.rsplit(".", 1)[-1] for n in on_tied})
            raise LoraTargetsError(f"{p}: LoRA on {', '.join(short)}, whose weight the model ties between its input "
                              "embedding and output head (tie_word_embeddings): merging the adapter would change "
                              f"both. Leave {', '.join(short)} out of the LoRA target modules")
    return model


def export_hf(policy: HFPolicy, tokenizer: HFTokenizer, out_dir: str | Path) -> Path:
    """A plain HF directory at ``out_dir``: merged safetensors weights, config.json, tokenizer files
    (+ ``adapter/`` under LoRA). Loads with ``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained``."""
    d = Path(out_dir)
    policy.save_pretrained(d)
    tokenizer.save(d)
    return d
