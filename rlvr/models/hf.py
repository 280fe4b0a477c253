"""Hugging Face causal LMs behind the policy surface of ``TinyTransformer`` (optional extra).

``transformers`` / ``peft`` are imported inside the functions, so ``import rlvr.models.hf`` is
cheap and the core library never needs them.

Loading (everything local; nothing is downloaded)::

    policy, tok = load_policy("path/to/model", dtype="bf16", lora=LoraSpec(r=8, alpha=16))
    if policy.load_note: print(policy.load_note)        # e.g. "pad_token was unset: using eos ..."

``HFPolicy`` has the surface ``rlvr.sampling`` uses: ``forward(ids, *, attention_mask,
positions, cache, logits_to_keep) -> float32 logits``, ``new_cache(batch_size, max_len)``,
``config.block_size``, ``num_params()``, ``flops_per_token()``, ``save_pretrained()``. So
``sampling.generate`` and ``sampling.sequence_token_logprobs`` work unchanged, and the logp
stored at sampling time equals the trainer's recomputation (to float rounding; tested at 1e-5).
In bf16 the cached decode and the one-shot forward round differently (measured |Δlogp| up to
~2e-3 on a tiny Llama), so the first-pass ratio is 1 only to ~0.2%; a bf16 trainer that wants it
exact should recompute ``logp_old`` with one no-grad forward instead of using ``Rollout.logp``.

Lean Llama forward: a plain ``LlamaForCausalLM`` (also under a peft LoRA wrapper; default RoPE,
no sliding window, no attention dropout) runs through ``HFPolicy``'s own forward, which calls the
model's weight-holding submodules (embeddings, norms, q/k/v/o projections, MLPs, head; so LoRA and
``adapter_disabled()`` act as usual) but replaces transformers' glue (mask building, DynamicCache,
rotary module, output capture) with a few tensor ops and a ``LeanCache``. Same logits to float
rounding (tested at 1e-5 against the transformers forward); several times less per-call overhead on
small models. ``HFPolicy(..., fast=False)`` / ``load_policy(..., fast=False)`` or
``policy.fast_path = False`` force the transformers forward; ``policy.fast_unsupported`` says why a
model cannot take the lean one (None = it can).

Conventions, the same as ``TinyTransformer``:

- Prompts are LEFT-padded; ``attention_mask`` (B, L) is 1 on real tokens. ``position_ids`` are
  ``cumsum(attention_mask) - 1`` clamped at 0 (offset by the cache's next positions when
  decoding), so a padded prompt gives the logits of the unpadded prompt.
- Every dropout of the wrapped model is set to 0 at load time (the rollout and the training
  forward must compute the same function; ``model.train()`` would otherwise change logp). The
  LoRA dropout of ``LoraSpec.dropout`` is kept as asked; anything > 0 makes the first-pass ratio
  differ from 1 in train mode, so the default is 0.

Reference policy with LoRA (USERS.md item 12): the base model with the adapter switched off, no
second copy::

    with torch.no_grad(), policy.adapter_disabled():
        logp_ref = sampling.sequence_token_logprobs(policy, rollout, temperature=T, top_p=1.0)

The reference is then always the *initial* model; a "refresh the reference" schedule has no
meaning (``ref.load_state_dict(model.state_dict())`` must be skipped for LoRA policies).

Export (USERS.md item 10): ``export_hf(policy, tok, out_dir)`` writes a plain HF directory
(``model.safetensors``, ``config.json``, tokenizer files) that ``AutoModelForCausalLM`` /
``AutoTokenizer.from_pretrained(out_dir)`` load without rlvr or peft. With LoRA the adapter is
merged into a copy of the model (the live model keeps its adapter) and the adapter alone is also
written to ``out_dir/adapter/`` (a PEFT directory whose ``base_model_name_or_path`` is the loaded
base); ``load_policy(base, adapter=out_dir/"adapter")`` resumes training from it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
"""Any one of these marks a directory as holding a tokenizer."""


class HFLoadError(ValueError):
    """A local Hugging Face directory that cannot be used; the message names the path and the fix."""


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


# ---------------------------------------------------------------------- cache
class HFCache:
    """transformers' ``DynamicCache`` plus the running attention mask and each row's next position.

    ``mask`` (B, length) long is the attention mask of every column seen so far (HF needs the full
    mask on each call); ``next_pos`` (B,) is each row's count of real tokens; ``max_len`` is the
    column budget (the DynamicCache grows, but a call past ``max_len`` raises like ``KVCache``).
    """

    def __init__(self, dynamic_cache, batch_size: int, max_len: int, device):
        _init_rows(self, batch_size, max_len, device)
        self.dc = dynamic_cache

    length = property(lambda self: self.mask.size(1))
    batch_size = property(lambda self: self.mask.size(0))

    def repeat_interleave(self, repeats: int) -> "HFCache":
        """Row b becomes rows b*repeats ... b*repeats+repeats-1. IN PLACE (DynamicCache repeats in
        place); returns ``self`` so it can be used like ``KVCache.repeat_interleave``."""
        self.dc.batch_repeat_interleave(repeats)
        _repeat_rows(self, repeats)
        return self


def _init_rows(cache, batch_size: int, max_len: int, device) -> None:
    """The bookkeeping both caches share: column budget, running attention mask (B, S), next positions (B,)."""
    cache.max_len = max_len
    cache.mask = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
    cache.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)


def _repeat_rows(cache, repeats: int) -> None:
    cache.mask = cache.mask.repeat_interleave(repeats, dim=0)
    cache.next_pos = cache.next_pos.repeat_interleave(repeats, dim=0)


_SMALL_ATTENTION = 16384
"""Lean path on CPU: queries x keys (L * S) up to this use explicit matmul attention (a few small
ops, ~3x cheaper than the CPU SDPA kernels at RL-sized shapes); larger ones use SDPA (no score matrix)."""


class LeanCache:
    """The lean Llama path's KV cache: per-layer key/value tensors (B, n_kv_heads, S, head_dim),
    rotary already applied, grown with ``torch.cat`` (so gradients flow through it), plus the
    running attention mask and each row's next position (the same fields as ``HFCache``)."""

    def __init__(self, n_layers: int, batch_size: int, max_len: int, device):
        _init_rows(self, batch_size, max_len, device)
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers

    length = property(lambda self: self.mask.size(1))
    batch_size = property(lambda self: self.mask.size(0))

    def repeat_interleave(self, repeats: int) -> "LeanCache":
        """Row b becomes rows b*repeats ... b*repeats+repeats-1 (out of place per tensor, so the
        autograd graph is kept); returns ``self`` like ``HFCache.repeat_interleave``."""
        self.k = [None if t is None else t.repeat_interleave(repeats, dim=0) for t in self.k]
        self.v = [None if t is None else t.repeat_interleave(repeats, dim=0) for t in self.v]
        _repeat_rows(self, repeats)
        return self


def _lean_llama_unsupported(hf_model: nn.Module) -> str | None:
    """Why the lean Llama forward cannot run ``hf_model`` (None = it can).

    The lean path needs a plain ``LlamaForCausalLM`` (exact class, its own layer classes), default
    RoPE over the full head dim, no sliding window and no attention dropout.
    """
    try:
        from transformers.models.llama import modeling_llama as ml
    except ImportError:  # pragma: no cover
        return "transformers has no Llama module"
    if type(hf_model) is not ml.LlamaForCausalLM:
        return f"{type(hf_model).__name__} is not LlamaForCausalLM"
    cfg = hf_model.config
    inner = getattr(hf_model, "model", None)
    if type(inner) is not ml.LlamaModel:
        return "inner model is not LlamaModel"
    layers = list(inner.layers)
    if len(layers) != cfg.num_hidden_layers:
        return "layer count differs from config.num_hidden_layers"
    for layer in layers:
        if type(layer) is not ml.LlamaDecoderLayer or type(layer.self_attn) is not ml.LlamaAttention:
            return "a decoder layer is not the stock LlamaDecoderLayer / LlamaAttention"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return f"unsupported rope parameters {rope!r}"
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        return f"rope_type {rope_type!r} (only 'default' RoPE is supported)"
    if rope.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        return "partial rotary embedding"
    if getattr(cfg, "sliding_window", None) is not None:
        return "sliding-window attention"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    rot = getattr(inner, "rotary_emb", None)
    if rot is not None and float(getattr(rot, "attention_scaling", 1.0)) != 1.0:
        return "rotary attention_scaling != 1"
    for layer in layers:
        if float(getattr(layer.self_attn, "attention_dropout", 0.0) or 0.0) != 0.0:
            return "attention dropout > 0"
    return None


def _peft_unsupported(model: nn.Module) -> str | None:
    """Only plain LoRA adapters act inside the wrapped modules; other peft types (prompt / prefix
    tuning) change the forward itself."""
    for name, cfg in getattr(model, "peft_config", {}).items():
        kind = str(getattr(getattr(cfg, "peft_type", None), "value", getattr(cfg, "peft_type", "")))
        if kind.upper() != "LORA":
            return f"peft adapter {name!r} is {kind}, not LoRA"
    return None


class _BlockConfig:
    """The bit of config ``rlvr.sampling`` reads (``block_size``), plus the HF config."""

    def __init__(self, hf_config, block_size: int | None):
        self.hf = hf_config
        self.block_size = block_size
        self.vocab_size = getattr(hf_config, "vocab_size", None)


def _block_size(cfg) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' per-load / per-save tqdm bars off for the block (restored after)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        yield
        return
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _zero_dropout(model: nn.Module) -> None:
    """p = 0 on every nn.Dropout and every float ``*dropout*`` attribute (e.g. Llama's attention_dropout)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name, v in list(vars(m).items()):
            if "dropout" in name and isinstance(v, float) and not isinstance(v, bool):
                setattr(m, name, 0.0)


# ---------------------------------------------------------------------- policy
class HFPolicy(nn.Module):
    """A ``transformers`` causal LM (optionally a peft LoRA model) with the rlvr policy surface."""

    differentiable_cache = True
    """Its KV cache (``LeanCache`` or DynamicCache, both grown with torch.cat) carries gradients, so
    the trainer may run a group's shared prompt once (``rlvr.sampling.sequence_token_logprobs(group_size=G)``)."""

    def __init__(self, model: nn.Module, *, source: str | None = None, load_note: str = "", fast: bool = True):
        super().__init__()
        self.model = model
        self.source = source
        self.load_note = load_note
        hf_cfg = model.config
        self.config = _BlockConfig(hf_cfg, _block_size(hf_cfg))
        fwd = self._hf_model().forward
        params = inspect.signature(fwd).parameters
        self._has_logits_to_keep = "logits_to_keep" in params
        # transformers >= 5.2x renamed past_key_values -> cache (the old name warns)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.fast_path = bool(fast)
        """Use the lean Llama forward when the model supports it (``fast_unsupported`` is None).
        Set False to force the transformers forward (an escape hatch; also what the tests compare to)."""
        self.fast_unsupported: str | None = (_lean_llama_unsupported(self._hf_model())
                                             or _peft_unsupported(self.model))
        """Why the lean Llama forward cannot be used for this model (None = it can)."""
        self._rope_tables: dict = {}

    # ------------------------------------------------------------------ structure
    @property
    def has_adapter(self) -> bool:
        return hasattr(self.model, "disable_adapter") and hasattr(self.model, "peft_config")

    def _hf_model(self) -> nn.Module:
        """The transformers model (under the peft wrapper when there is one)."""
        return self.model.get_base_model() if self.has_adapter else self.model

    @property
    def hf_config(self):
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ------------------------------------------------------------------ forward
    def forward(self, ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, cache: HFCache | None = None,
                logits_to_keep: int | None = None) -> torch.Tensor:
        """Float32 logits (B, L, V), or (B, logits_to_keep, V) for the last positions only.

        ``attention_mask`` (B, L) marks real tokens (None = all real). With ``cache`` the mask
        columns are appended to ``cache.mask`` and positions continue from ``cache.next_pos``.
        ``positions`` (B, L) overrides the computed position ids.
        """
        B, L = ids.shape
        am = (torch.ones_like(ids, dtype=torch.long) if attention_mask is None
              else attention_mask.to(device=ids.device, dtype=torch.long))                  # (B, L)
        if cache is not None:
            if cache.length + L > cache.max_len:
                raise ValueError(f"KV cache full: {cache.length} + {L} tokens > max_len {cache.max_len}")
            full_am = torch.cat([cache.mask, am], dim=1)                                    # (B, S)
        else:
            full_am = am
        if positions is None:
            positions = (am.cumsum(1) - 1).clamp_min(0)                                     # (B, L)
            if cache is not None:
                positions = positions + cache.next_pos.unsqueeze(1)
        bs = self.config.block_size
        if bs is not None and L > 0 and int(positions.max()) >= bs:
            raise ValueError(f"position {int(positions.max())} >= block_size {bs} (max_position_embeddings)")

        if isinstance(cache, LeanCache) or (cache is None and self._lean_active()):
            logits = self._lean_forward(ids, am, full_am, positions, cache, logits_to_keep)
            if cache is not None:
                cache.mask = full_am
                cache.next_pos = cache.next_pos + am.sum(1)
            return logits.float()

        kwargs = dict(input_ids=ids, attention_mask=full_am, position_ids=positions,
                      use_cache=cache is not None, return_dict=True)
        if cache is not None:
            kwargs[self._cache_kw] = cache.dc
        if logits_to_keep is not None and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = int(logits_to_keep)
        out = self.model(**kwargs)
        logits = out.logits
        if logits_to_keep is not None and logits.size(1) != logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        if cache is not None:
            cache.mask = full_am
            cache.next_pos = cache.next_pos + am.sum(1)
            new_dc = out.get("cache") if "cache" in out else out.get("past_key_values")
            if new_dc is not None and new_dc is not cache.dc:
                cache.dc = new_dc
        return logits.float()

    def new_cache(self, batch_size: int, max_len: int) -> HFCache | LeanCache:
        """An empty cache for ``batch_size`` rows: a ``LeanCache`` when the lean Llama forward is in
        use, else an ``HFCache`` (DynamicCache built from the model config). ``forward`` picks the
        path from the cache's type, so a cache keeps its path even if ``fast_path`` changes."""
        if self._lean_active():
            return LeanCache(self._hf_model().config.num_hidden_layers, batch_size, max_len,
                             next(self.model.parameters()).device)
        from transformers import DynamicCache

        try:
            dc = DynamicCache(config=self._hf_model().config)
        except TypeError:  # older transformers
            dc = DynamicCache()
        return HFCache(dc, batch_size, max_len, next(self.model.parameters()).device)

    # ------------------------------------------------------------------ lean Llama forward
    @property
    def uses_fast_path(self) -> bool:
        """True when a call without a cache would take the lean Llama forward now."""
        return self._lean_active()

    def _lean_active(self) -> bool:
        if not self.fast_path or self.fast_unsupported is not None:
            return False
        # gradient checkpointing lives in transformers' layer call; honour it by falling back
        return not (self.training and getattr(self._hf_model().model, "gradient_checkpointing", False))

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, L, 1, head_dim) in ``dtype`` for ``positions`` (B, L), from a table cached per
        device / dtype / inverse-frequency buffer and grown to the longest position seen.

        As transformers does: ``freqs = pos.float() * inv_freq`` in float32, ``emb = cat(freqs,
        freqs)``, cos / sin in float32, cast to the activations' dtype. ``sin`` is returned with its
        first half negated so that ``rotate_half(x) * sin == x.roll(head_dim // 2, -1) * sin_signed``
        (exactly: negation is exact).
        """
        hf = self._hf_model()
        rot = getattr(hf.model, "rotary_emb", None)
        inv_freq = getattr(rot, "inv_freq", None)
        if inv_freq is None:  # pragma: no cover - stock Llama always has the buffer
            cfg = hf.config
            rope = getattr(cfg, "rope_parameters", None) or {}
            base = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
            dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=positions.device) / dim))
        dev = positions.device
        key = (dev, dtype, inv_freq.data_ptr(), inv_freq.dtype, inv_freq._version)
        tab = self._rope_tables.get(key)
        bs = self.config.block_size      # forward has checked positions < block_size already
        need = bs if bs is not None else (int(positions.max()) + 1 if positions.numel() else 1)
        if tab is None or tab[0].size(0) < need:
            n = max(need, 64)
            f = inv_freq.to(device=dev, dtype=torch.float)
            freqs = torch.arange(n, device=dev, dtype=torch.long).float()[:, None] * f   # (n, D/2)
            cos_h, sin_h = freqs.cos(), freqs.sin()
            cos = torch.cat([cos_h, cos_h], dim=-1).to(dtype)
            sin = torch.cat([-sin_h, sin_h], dim=-1).to(dtype)
            self._rope_tables = {k: v for k, v in self._rope_tables.items() if k[:2] != key[:2]}  # stale
            tab = self._rope_tables[key] = (cos, sin)
        cos, sin = tab
        return cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)

    def _lean_forward(self, ids, am, full_am, positions, cache: LeanCache | None, logits_to_keep):
        """Llama forward with the model's own weight-holding submodules (LoRA layers included) and
        only the glue replaced: RoPE from a cached table, GQA by head repeat, SDPA with an explicit
        boolean mask (causal by column + key padding; a query always sees its own column, so rows
        at pad positions stay finite), the ``LeanCache`` and ``logits_to_keep`` before the head."""
        hf = self._hf_model()
        inner = hf.model
        B, L = ids.shape
        past = 0 if cache is None else cache.length
        S = past + L
        h = inner.embed_tokens(ids)                                                  # (B, L, d)
        cos, sin = self._rope(positions, h.dtype)                                    # (B, L, 1, D)

        # mask (B, L, S) bool, True = attend: key column j <= query column past+i, and the key is real
        # or it is the query's own column (so no row is fully masked: pad queries stay finite)
        keym = full_am.bool()                                                        # (B, S)
        if L == 1:
            mask = keym.clone()
            mask[:, -1] = True
            mask = mask[:, None, :]                                                  # (B, 1, S)
        else:
            qcol = torch.arange(past, S, device=ids.device)[:, None]                 # (L, 1)
            kcol = torch.arange(S, device=ids.device)[None, :]                       # (1, S)
            mask = (keym[:, None, :] | (kcol == qcol)[None]) & (kcol <= qcol)[None]  # (B, L, S)

        cfg = hf.config
        H = cfg.num_attention_heads
        Hkv = getattr(cfg, "num_key_value_heads", None) or H
        rep = H // Hkv
        # small score matrices on CPU: explicit baddbmm / softmax / bmm with a shared additive mask
        # (the CPU flash kernel costs ~3x more at these sizes, backward included); else SDPA
        small = ids.device.type == "cpu" and L * S <= _SMALL_ATTENTION
        if small:
            addmask = torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill_(~mask, float("-inf"))
            addmask = addmask[:, None, None].expand(B, Hkv, rep, L, S).reshape(B * Hkv, rep * L, S)
        else:
            sdpa_mask = mask[:, None]                                                # (B, 1, L, S)

        for li, layer in enumerate(inner.layers):
            attn = layer.self_attn
            D = attn.head_dim
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(B, L, H, D)
            k = attn.k_proj(x).view(B, L, Hkv, D)
            v = attn.v_proj(x).view(B, L, Hkv, D).transpose(1, 2)                    # (B, Hkv, L, D)
            q = (q * cos + q.roll(D // 2, dims=-1) * sin).transpose(1, 2)            # (B, H, L, D)
            k = (k * cos + k.roll(D // 2, dims=-1) * sin).transpose(1, 2)            # (B, Hkv, L, D)
            if cache is not None:
                if cache.k[li] is not None:
                    k = torch.cat([cache.k[li], k], dim=2)
                    v = torch.cat([cache.v[li], v], dim=2)
                cache.k[li], cache.v[li] = k, v
            if small:
                # the rep query heads of a kv head attend to its keys as one batch: no head repeat
                s_ = torch.baddbmm(addmask, q.reshape(B * Hkv, rep * L, D),
                                   k.reshape(B * Hkv, S, D).transpose(1, 2), alpha=attn.scaling)
                pr = torch.softmax(s_, dim=-1, dtype=torch.float32).to(v.dtype)
                o = torch.bmm(pr, v.reshape(B * Hkv, S, D))                          # (B*Hkv, rep*L, D)
            elif rep > 1 and L == 1:    # one query: group the heads as queries of their kv head
                o = F.scaled_dot_product_attention(q.reshape(B, Hkv, rep, D), k, v, attn_mask=sdpa_mask,
                                                   scale=attn.scaling)
            else:
                if rep > 1:
                    k = k[:, :, None].expand(B, Hkv, rep, S, D).reshape(B, H, S, D)
                    v = v[:, :, None].expand(B, Hkv, rep, S, D).reshape(B, H, S, D)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, scale=attn.scaling)
            o = o.reshape(B, H, L, D).transpose(1, 2).reshape(B, L, H * D)
            h = h + attn.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))

        k_keep = int(logits_to_keep) if logits_to_keep is not None else 0
        if 0 < k_keep < L:
            h = h[:, -k_keep:]
        return hf.lm_head(inner.norm(h))

    # ------------------------------------------------------------------ LoRA reference
    @contextlib.contextmanager
    def adapter_disabled(self):
        """Run the base model (adapter off) inside the block: the reference policy without a copy.

        ``with torch.no_grad(), policy.adapter_disabled(): logp_ref = sequence_token_logprobs(policy, ...)``.
        Raises ``ValueError`` for a policy without a LoRA adapter (deep-copy it for a reference).
        """
        if not self.has_adapter:
            raise ValueError("adapter_disabled(): this policy has no LoRA adapter; use a frozen copy as reference")
        with self.model.disable_adapter():
            yield self

    reference = adapter_disabled

    # ------------------------------------------------------------------ accounting
    def num_params(self) -> int:
        """Distinct parameters (tied weights once; LoRA adapter weights included)."""
        return sum(p.numel() for p in self.model.parameters())

    def trainable_params(self) -> list[nn.Parameter]:
        """The parameters with ``requires_grad`` (the adapter only under LoRA): give these to the optimizer."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def _matmul_params(self) -> tuple[int, int]:
        """(all, trainable) weight elements of Linear / GPT-2 Conv1D layers, the output head included."""
        n = n_train = 0
        for m in self.model.modules():
            w = getattr(m, "weight", None)
            if isinstance(w, torch.Tensor) and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"):
                n += w.numel()
                n_train += w.numel() if w.requires_grad else 0
        return n, n_train

    def flops_per_token(self, seq_len: int | None = None, *, training: bool = True) -> int:
        """FLOPs per token: forward ``2 N + 4 n_layer d seq_len``; training adds the backward.

        N = weights of every Linear (and GPT-2 Conv1D), output head included, input embedding
        excluded (a lookup); LoRA A/B matrices count as Linear layers. The backward costs 2 N for
        input gradients plus 2 N_trainable for weight gradients, so training is
        ``4 N + 2 N_trainable + 12 n_layer d seq_len`` — the usual 6 N for full fine-tuning,
        nearer 4 N under LoRA. ``seq_len`` defaults to ``block_size``; as for ``TinyTransformer``
        the attention term is an upper bound by about 2x for causal attention.
        """
        cfg = self._hf_model().config.get_text_config() if hasattr(self.hf_config, "get_text_config") else self.hf_config
        n_layer = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer")
        d = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd")
        T = (self.config.block_size or 0) if seq_len is None else seq_len
        n, n_train = self._matmul_params()
        if training:
            return int(4 * n + 2 * n_train + 12 * n_layer * d * T)
        return int(2 * n + 4 * n_layer * d * T)

    # ------------------------------------------------------------------ save
    def merged_model(self) -> nn.Module:
        """A plain transformers model with the adapter merged in (a copy; the live model is untouched).

        Without an adapter, the wrapped model itself.
        """
        if not self.has_adapter:
            return self.model
        return copy.deepcopy(self.model).merge_and_unload()

    def save_pretrained(self, directory: str | Path) -> None:
        """HF format into ``directory``: ``model.safetensors`` (sharded when large) + ``config.json``.

        With LoRA the weights are merged (on a copy) and the adapter alone goes to ``directory/adapter``.
        Tokenizer files are written by ``HFTokenizer.save`` (``export_hf`` does both).
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        with _no_progress_bars():
            merged = self.merged_model()
            merged.save_pretrained(str(d), safe_serialization=True)
            if self.has_adapter:
                self.model.save_pretrained(str(d / "adapter"), safe_serialization=True)


# ---------------------------------------------------------------------- tokenizer
class HFTokenizer:
    """A transformers tokenizer with the ``CharTokenizer`` surface the trainer uses.

    ``encode(text)`` never appends eos and adds no special tokens except a leading BOS when the
    tokenizer adds one by default (Llama-style ``add_bos_token``); ``bos=True/False`` forces it.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        with_sp = tokenizer.encode("a", add_special_tokens=True)
        without = tokenizer.encode("a", add_special_tokens=False)
        self.adds_bos = (tokenizer.bos_token_id is not None and len(with_sp) > len(without)
                         and with_sp[0] == tokenizer.bos_token_id)

        # read once: transformers' token-id properties cost microseconds of Python each
        self.pad_id: int = tokenizer.pad_token_id
        self.eos_id: int | None = tokenizer.eos_token_id
        self.bos_id: int | None = tokenizer.bos_token_id

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)``, added tokens included (the model's embedding may be larger)."""
        return len(self.tok)

    @property
    def special_ids(self) -> tuple[int, ...]:
        return tuple(self.tok.all_special_ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str, *, bos: bool | None = None, eos: bool = False) -> list[int]:
        """Ids of ``text``: no specials, except BOS first when the tokenizer adds it by default
        (or ``bos=True``), and eos last only with ``eos=True``."""
        ids = self._ids(text)
        want_bos = self.adds_bos if bos is None else bos
        if want_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def _ids(self, text: str) -> list[int]:
        # the Rust backend directly: transformers' own encode costs ~100 µs of Python per call
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is not None:
            return backend.encode(text, add_special_tokens=False).ids
        return list(self.tok.encode(text, add_special_tokens=False))

    def encode_prompt(self, prompt) -> list[int]:
        """A plain string goes through ``encode``; a list of ``{"role", "content"}`` messages through
        the chat template with ``add_generation_prompt=True`` (the template supplies BOS itself)."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                            for m in prompt):
            raise ValueError("encode_prompt: expected a string or a list of {'role', 'content'} dicts, "
                             f"got {type(prompt).__name__}")
        if not self.has_chat_template:
            raise ValueError("encode_prompt: the task gives chat messages but the tokenizer has no chat_template")
        ids = self.tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, return_dict=False)
        if hasattr(ids, "keys"):  # a BatchEncoding on some versions
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, ids, *, stop_at_eos: bool = True) -> str:
        """Text of ``ids`` (list or 1-D tensor), special tokens skipped; stops at the first eos by default."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        ids = list(ids)
        if stop_at_eos and self.eos_id is not None and self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        return self.tok.decode(ids, skip_special_tokens=True)

    def save(self, path: str | Path) -> None:
        """``save_pretrained`` into the directory ``path``; a path ending in ``.json`` (as the trainer
        passes ``ckpt/"tokenizer.json"``) means its parent directory (where HF writes tokenizer.json)."""
        p = Path(path)
        if p.suffix == ".json":
            p = p.parent
        p.mkdir(parents=True, exist_ok=True)
        self.tok.save_pretrained(str(p))

    @classmethod
    def load(cls, path: str | Path) -> "HFTokenizer":
        from transformers import AutoTokenizer

        p = Path(path)
        return cls(AutoTokenizer.from_pretrained(str(p.parent if p.suffix == ".json" else p), local_files_only=True))

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.tok).__name__}, vocab={self.vocab_size}, pad={self.pad_id}, eos={self.eos_id})"


# ---------------------------------------------------------------------- loading
def _check_dir(path: Path) -> None:
    """Refuse before any compute, naming the path and the fix."""
    if not path.exists():
        raise HFLoadError(f"{path}: no such directory (models are loaded from a local directory only)")
    if not path.is_dir():
        raise HFLoadError(f"{path}: not a directory; give the directory holding config.json and the weights")
    if not (path / "config.json").is_file():
        if (path / "adapter_config.json").is_file():
            raise HFLoadError(f"{path}: this is a PEFT adapter directory; load its base model and pass adapter={str(path)!r}")
        raise HFLoadError(f"{path}: no config.json; not a Hugging Face model directory")
    has_st = any(path.glob("*.safetensors"))
    if not has_st:
        if (path / "pytorch_model.bin").is_file() or any(path.glob("pytorch_model*.bin")):
            raise HFLoadError(f"{path}: only pytorch_model*.bin (pickle) weights; rlvr loads safetensors only. "
                              "Convert once: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir) "
                              "writes model.safetensors")
        raise HFLoadError(f"{path}: no weights (expected model.safetensors or model-*.safetensors shards)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise HFLoadError(f"{path}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)}); "
                          "save the tokenizer into the model directory (tokenizer.save_pretrained(dir))")


def load_policy(path: str | Path, *, dtype: str | torch.dtype = "fp32", lora: LoraSpec | None = None,
                adapter: str | Path | None = None, device: str | torch.device = "cpu",
                attn_implementation: str | None = "sdpa", fast: bool = True) -> tuple[HFPolicy, HFTokenizer]:
    """Load ``AutoModelForCausalLM`` + ``AutoTokenizer`` from the local directory ``path``.

    ``dtype`` "fp32" or "bf16" (the weights; logits are always returned as float32). ``lora``
    wraps the model in a fresh peft LoRA adapter (only its weights are trainable); ``adapter``
    instead loads a saved trainable adapter directory (``out_dir/adapter`` of ``export_hf``),
    to resume. Without either, every weight is trainable.

    A tokenizer without a pad token gets pad = eos (or a new ``<pad>`` token, embeddings resized,
    when there is no eos either); what was done is in ``policy.load_note`` (empty if nothing) for
    the caller to print. ``fast`` (default True) runs a plain ``LlamaForCausalLM`` (LoRA or not)
    through the lean forward of ``HFPolicy`` (same numbers, a fraction of transformers' per-call
    overhead); ``fast=False``, or any other model, uses the transformers forward (see
    ``HFPolicy.fast_unsupported``). Raises ``HFLoadError`` (a ``ValueError``) naming the path when the
    directory, its safetensors weights, or its tokenizer files are missing.
    """
    p = Path(path)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        torch_dtype = DTYPES[dtype]
    else:
        torch_dtype = dtype
    _check_dir(p)
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
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation
    try:
        with _no_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(str(p), **kw)
    except Exception as e:  # noqa: BLE001
        raise HFLoadError(f"{p}: cannot load the model: {type(e).__name__}: {e}") from e

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

    _zero_dropout(model)
    if lora is not None or adapter is not None:
        import peft

        if lora is not None:
            cfg = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                  target_modules=lora.target_modules, bias="none", task_type="CAUSAL_LM")
            model = peft.get_peft_model(model, cfg)
        else:
            with _no_progress_bars():
                model = peft.PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    model = model.to(device)
    model.eval()
    return HFPolicy(model, source=str(p), load_note="\n".join(notes), fast=fast), HFTokenizer(hf_tok)


def export_hf(policy: HFPolicy, tokenizer: HFTokenizer, out_dir: str | Path) -> Path:
    """A plain HF directory at ``out_dir``: merged safetensors weights, config.json, tokenizer files
    (+ ``adapter/`` under LoRA). Loads with ``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained``."""
    d = Path(out_dir)
    policy.save_pretrained(d)
    tokenizer.save(d)
    return d
