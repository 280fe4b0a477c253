"""The lean Llama forward: a stock ``LlamaForCausalLM``'s own weights with transformers' glue replaced
(and Mistral's, Qwen 2's, Qwen 3's, Gemma 1 / 2 / 3's, Phi-3's: the same layers, Qwen 2 with q/k/v
biases, Qwen 3 with per-head q/k norms, the Gemmas with (1 + w) norms, Gemma 2 / 3 with norms around
the attention and the MLP, Phi-3 with fused projections; ``lean_families``).

``lean_forward`` calls the model's weight-holding submodules (embeddings, norms, q/k/v/o
projections, MLPs, head; so peft LoRA layers and ``disable_adapter()`` act as usual) but replaces
transformers' glue (mask building, DynamicCache, rotary module, output capture) with a few tensor
ops, a ``RopeTable`` and a ``LeanCache``. Same logits to float rounding (tested at 1e-5 against the
transformers forward); several times less per-call overhead on small models. Decode steps (no
gradient, CPU, float32, few rows) compute the projections weight-major (``linear_t``: W @ x.T, with
plain LoRA adapters unrolled in peft's order), which BLAS runs faster at those row counts; under CPU
bf16 autocast too, from the bf16 weight copies of ``bf16_weights()``, with autocast's numbers (there
q/k/v and gate/up each in one product from stacked copies, the head from a prepacked copy) where
this CPU's bf16 products round alike in both layouts, else row-major from prepacked copies of the
frozen weights (``decode_reads_packs``; q/k/v and gate/up each from one stacked pack,
``_stacked_linear``; every pack's product probed for autocast's bits at its shapes and row count,
``_pack_ok``; the copies of frozen weights are kept across regions).

``lean_llama_unsupported(model)`` / ``peft_unsupported(model)`` say why a model cannot take this
path (None = it can): it needs a plain ``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, a Gemma 1 / 2 / 3 or a ``Phi3ForCausalLM`` (static RoPE
over the full head dim: ``STATIC_ROPE``, no attention dropout) and, under peft, LoRA adapters only.

Shapes: B rows, L tokens in this call, S keys attended (cache length + L), H query heads, Hkv
key/value heads, D head dim, rep = H // Hkv.

``transformers`` is imported inside the functions only.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref

import torch
import torch.utils.checkpoint
import torch.nn as nn
import torch.nn.functional as F

from rlvr.compiled import compile_available, compiled_call

SMALL_ATTENTION = 16384
"""On CPU, queries x keys (L * S) up to this use explicit matmul attention (a few small ops, ~3x
cheaper than the CPU SDPA kernels at RL-sized shapes); larger ones use SDPA (no score matrix)."""

GROUP_ATTENTION_FLOPS = 4.0
"""A cache repeated for G samples per prompt takes the grouped layout (``LeanCache``) when
(prefix + G * new) / (prefix + new) <= this, ``new`` being the columns left to decode: the score
FLOPs of letting a prompt's G rows attend to each other's columns (masked) over those of each row
attending to its own. Measured on CPU (2 threads, SmolLM2's heads), the grouped layout's attention
per decode step: 0.63x at ratio 2.8 (prompt 47, G = 8, 16 new tokens), 0.84x at 5.5 (prompt 300,
G = 16, 128 new), 1.1x at 4.9-6.3, 1.7-1.8x at 6.7-6.9: it reads the prompt's keys once per prompt
instead of once per row, in G times larger products."""
LIVE_ROWS = 0.75
"""A CPU decode step without gradient in which at most this fraction of the rows is still decoding
(the others produced eos earlier; their new column is masked) runs the layers' products, norms and
the output head on the live rows only (``_live_rows``): they are compute-bound at a sampling call's
row counts, so their time falls with the rows. The finished rows get zero queries, keys and values
(columns nobody attends to but themselves) and zero logits (the sampler's draw for them is
discarded). Moving the rows in and out costs four small copies a layer: on SmolLM2 (64 rows) about
6-8 ms a step with every row live, against ~0.7 ms of products and norms saved per finished row,
so it pays from about a tenth of the rows finished; this bound keeps a margin. The products give
each row the same bits whatever the number of rows computed with it (bf16; fp32 from 12 rows up,
see ``linear_t``), so a live row's numbers do not depend on how many others have finished, except
in fp32 with 2-11 live rows, where MKL rounds differently."""
GROUP_SCORES = 1 << 22
"""Grouped attention computes its score matrix (P * Hkv, G * L * rep, S) in query chunks of at most
about this many elements (a decode step is one chunk; a many-token call is split)."""


# ---------------------------------------------------------------------- cache bookkeeping
def init_rows(cache, batch_size: int, max_len: int, device) -> None:
    """The bookkeeping every rlvr KV cache shares: column budget ``max_len``, the running attention
    mask ``mask`` (B, S) long of every column seen so far, each row's next position ``next_pos`` (B,)."""
    cache.max_len = max_len
    cache.mask = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
    cache.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)


def repeat_rows(cache, repeats: int) -> None:
    """Row b of ``mask`` / ``next_pos`` becomes rows b*repeats ... b*repeats+repeats-1."""
    cache.mask = cache.mask.repeat_interleave(repeats, dim=0)
    cache.next_pos = cache.next_pos.repeat_interleave(repeats, dim=0)


class LeanCache:
    """The lean path's KV cache: per-layer key/value tensors (B, Hkv, S, D), rotary already applied,
    plus the running attention mask and each row's next position (see ``init_rows``).

    Two ways to grow, chosen per append: with gradient enabled the tensors are grown with
    ``torch.cat`` (so gradients flow through the cache: the training forward's shared prompt);
    without gradient (sampling) the first append allocates (B, Hkv, max_len, D) buffers and every
    later one writes its columns in place, so a decode step copies one column, not the whole cache.
    ``k[li]`` / ``v[li]`` are then views of the first S columns of those buffers.

    Grouped layout (``group`` = G > 1, see ``repeat_interleave``): the P prompts' keys / values are
    kept once, not G times, and the G rows of a prompt append theirs after them, step by step:
    ``v[li]`` is (P, Hkv, prefix + G * n, D) with column ``prefix + s * G + g`` = row g's step s,
    and ``k[li]`` holds the keys transposed, (P, Hkv, D, prefix + G * n), as the scores' product
    reads them (a transposed view of a buffer's first columns would be copied by that product at
    every layer of every step). ``lean_forward`` then lets the G * rep query heads of a prompt's kv
    head attend to its columns as one product, each query masked to the prompt's columns and its
    own row's."""

    def __init__(self, n_layers: int, batch_size: int, max_len: int, device):
        init_rows(self, batch_size, max_len, device)
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self._kbuf: list[torch.Tensor | None] = [None] * n_layers
        self._vbuf: list[torch.Tensor | None] = [None] * n_layers
        self.group = 1
        """G > 1 in the grouped layout: rows b*G ... b*G+G-1 share the first ``prefix`` columns."""
        self.prefix = 0
        """Columns stored once per group (the prompt's) in the grouped layout."""

    length = property(lambda self: self.mask.size(1))
    batch_size = property(lambda self: self.mask.size(0))

    def append(self, li: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``li``'s keys / values (B, Hkv, L, D) appended after its S0 cached columns; returns the
        (B, Hkv, S0 + L, D) keys and values to attend to; in the grouped layout (P, Hkv, prefix +
        G * (n + L), D) values and the keys transposed, (P, Hkv, D, prefix + G * (n + L)), after n
        steps (no gradient)."""
        if self.group > 1:
            return self._append_grouped(li, k, v)
        past = 0 if self.k[li] is None else self.k[li].size(2)
        if torch.is_grad_enabled():     # an in-place write could change a tensor backward has saved
            if self.k[li] is not None:
                k = torch.cat([self.k[li], k], dim=2)
                v = torch.cat([self.v[li], v], dim=2)
            self._kbuf[li] = self._vbuf[li] = None
        else:
            kb, vb = self._kbuf[li], self._vbuf[li]
            if kb is None:              # the first append without gradient (the forward checks max_len)
                B, Hkv, _, D = k.shape
                kb = k.new_empty(B, Hkv, self.max_len, D)
                vb = v.new_empty(kb.shape)
                if past:
                    kb[:, :, :past] = self.k[li]
                    vb[:, :, :past] = self.v[li]
                self._kbuf[li], self._vbuf[li] = kb, vb
            S = past + k.size(2)
            kb[:, :, past:S] = k
            vb[:, :, past:S] = v
            k, v = kb[:, :, :S], vb[:, :, :S]
        self.k[li], self.v[li] = k, v
        return k, v

    def _append_grouped(self, li: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Grouped layout: the G rows' L new columns of each prompt written after its n steps."""
        if torch.is_grad_enabled():
            raise RuntimeError("a LeanCache in the grouped layout is written without gradient only")
        G = self.group
        B, Hkv, L, D = k.shape
        P = B // G
        kb, vb = self._kbuf[li], self._vbuf[li]                   # (P, Hkv, D, cols), (P, Hkv, cols, D)
        past = self.v[li].size(2)
        S = past + G * L
        kb[..., past:S].view(P, Hkv, D, L, G).copy_(k.reshape(P, G, Hkv, L, D).permute(0, 2, 4, 3, 1))
        vb[:, :, past:S].view(P, Hkv, L, G, D).copy_(v.reshape(P, G, Hkv, L, D).permute(0, 2, 3, 1, 4))
        self.k[li], self.v[li] = kb[..., :S], vb[:, :, :S]
        return self.k[li], self.v[li]

    def _groupable(self, repeats: int) -> bool:
        """Whether ``repeat_interleave(repeats)`` takes the grouped layout: no gradient, CPU, every
        layer filled in place, and attending to a prompt's G rows' columns at once costs at most
        ``GROUP_ATTENTION_FLOPS`` times the score FLOPs of each row attending to its own."""
        if repeats < 2 or self.group > 1 or torch.is_grad_enabled() or self.mask.device.type != "cpu":
            return False
        if any(t is None for t in self.k) or any(b is None for b in self._kbuf):
            return False
        S0, new = self.length, self.max_len - self.length
        return (S0 + repeats * new) <= GROUP_ATTENTION_FLOPS * (S0 + new)

    def repeat_interleave(self, repeats: int) -> "LeanCache":
        """Row b becomes rows b*repeats ... b*repeats+repeats-1 (out of place per tensor, so the
        autograd graph is kept); returns ``self`` like ``HFCache.repeat_interleave``.

        Without gradient on CPU, where ``_groupable`` says so, the rows are repeated in the
        bookkeeping only and the keys / values take the grouped layout (class docstring): the
        prompt's columns are not copied G times and a decode step reads them once per prompt."""
        if self._groupable(repeats):
            S0 = self.length
            cols = S0 + repeats * (self.max_len - S0)
            for li, t in enumerate(self.k):
                P, Hkv, _, D = t.shape
                self._kbuf[li] = t.new_empty(P, Hkv, D, cols)                 # keys transposed
                self._vbuf[li] = t.new_empty(P, Hkv, cols, D)
                self._kbuf[li][..., :S0] = t.transpose(2, 3)
                self._vbuf[li][:, :, :S0] = self.v[li]
                self.k[li], self.v[li] = self._kbuf[li][..., :S0], self._vbuf[li][:, :, :S0]
            self.group, self.prefix = repeats, S0
            repeat_rows(self, repeats)
            return self
        if self.group > 1:
            raise RuntimeError("a LeanCache in the grouped layout cannot be repeated again")
        for li, t in enumerate(self.k):
            if t is None:
                continue
            if self._kbuf[li] is not None:                              # keep the preallocated columns
                self._kbuf[li] = self._kbuf[li].repeat_interleave(repeats, dim=0)
                self._vbuf[li] = self._vbuf[li].repeat_interleave(repeats, dim=0)
                S = t.size(2)
                self.k[li], self.v[li] = self._kbuf[li][:, :, :S], self._vbuf[li][:, :, :S]
            else:
                self.k[li] = t.repeat_interleave(repeats, dim=0)
                self.v[li] = self.v[li].repeat_interleave(repeats, dim=0)
                self._kbuf[li] = self._vbuf[li] = None
        repeat_rows(self, repeats)
        return self


# ---------------------------------------------------------------------- capability checks
STATIC_ROPE = ("default", "linear", "llama3")
"""RoPE types whose frequencies transformers computes once, into the rotary module's ``inv_freq``
buffer, with no attention scaling: the lean forward's ``RopeTable`` reads that buffer, so it rotates
as transformers does (Llama 3.1 / 3.2 use ``llama3``). Dynamic ones (``dynamic``, ``longrope``)
change the frequencies with the length, and ``yarn`` scales the attention: those take transformers'
forward."""
_FAMILIES: dict = {}


def lean_families() -> dict[type, tuple[type, type, type, type]]:
    """The causal-LM classes the lean forward runs, each with its (model, decoder layer, attention,
    MLP) classes: Llama, Mistral, Qwen 2, Qwen 3 and Gemma 1, 2 and 3 (text), whose layers compute
    the same function (RMSNorm, rotary q/k, grouped-query attention, gated MLP); Qwen 2's q/k/v
    projections carry biases, which the products here add as its Linear layers do, and Qwen 3 and
    Gemma 3 normalize each query and key head before the rotation (``q_norm`` / ``k_norm``,
    ``_head_norm_t``). The Gemmas scale their embeddings (their embedding modules do), compute
    RMSNorm as x * (1 + w) (their norm modules are called) and gate with tanh-GELU (their
    ``act_fn``); Gemma 2 and 3 also normalize the attention's and the MLP's outputs before their
    residual adds (``_sandwich``), Gemma 2 soft-caps its attention scores and logits
    (``_softcap``), Gemma 3 has a rotary table per layer type (``layer_rope_types``). Phi-3 fuses
    q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (``_qkv_mods``,
    ``_gate_up_mods``: the same rows, as the stacked products already compute them). Those
    transformers lacks are left out."""
    if not _FAMILIES:
        import importlib

        for mod, prefix, inner in (("llama", "Llama", "Model"), ("mistral", "Mistral", "Model"),
                                   ("qwen2", "Qwen2", "Model"), ("qwen3", "Qwen3", "Model"),
                                   ("gemma", "Gemma", "Model"), ("gemma2", "Gemma2", "Model"),
                                   ("phi3", "Phi3", "Model"),
                                   ("gemma3", "Gemma3", "TextModel")):
            try:
                m = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
                _FAMILIES[getattr(m, f"{prefix}ForCausalLM")] = tuple(
                    getattr(m, f"{prefix}{part}") for part in (inner, "DecoderLayer", "Attention", "MLP"))
            except (ImportError, AttributeError):  # pragma: no cover - an older transformers
                continue
    return _FAMILIES


def lean_llama_unsupported(hf_model: nn.Module) -> str | None:
    """Why the lean Llama forward cannot run ``hf_model`` (None = it can).

    The lean path needs a plain ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
    ``Qwen3ForCausalLM``, ``GemmaForCausalLM``, ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM`` or
    ``Phi3ForCausalLM`` (exact class, its own model, layer and attention classes: ``lean_families``;
    another MLP module is called as it is), static RoPE (``STATIC_ROPE``; each table's, where there
    is one per layer type: ``layer_rope_types``) over the full head dim, no attention or residual
    dropout and causal attention. Sliding windows are masked as transformers masks them
    (``layer_windows``), soft-capped scores and logits capped as it caps them (``_softcap``).
    """
    families = lean_families()
    if type(hf_model) not in families:
        names = ", ".join(sorted(c.__name__ for c in families))
        return f"{type(hf_model).__name__} is not one of {names}"
    model_t, layer_t, attn_t, _ = families[type(hf_model)]
    cfg = hf_model.config
    inner = getattr(hf_model, "model", None)
    if type(inner) is not model_t:
        return f"inner model is not {model_t.__name__}"
    layers = list(inner.layers)
    if len(layers) != cfg.num_hidden_layers:
        return "layer count differs from config.num_hidden_layers"
    for layer in layers:
        if type(layer) is not layer_t or type(layer.self_attn) is not attn_t:
            return f"a decoder layer is not the stock {layer_t.__name__} / {attn_t.__name__}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return f"unsupported rope parameters {rope!r}"
    rot = getattr(inner, "rotary_emb", None)
    keys = sorted({t for t in layer_rope_types(hf_model) if t is not None})
    for key in keys or [None]:          # Gemma 3: one table per layer type, each with its own parameters
        params = rope if key is None else rope.get(key) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in STATIC_ROPE:
            return f"rope_type {rope_type!r} (the lean forward takes {', '.join(repr(t) for t in STATIC_ROPE)})"
        if params.get("partial_rotary_factor", 1.0) not in (None, 1.0):
            return "partial rotary embedding"
        scaling = getattr(rot, "attention_scaling" if key is None else f"{key}_attention_scaling", 1.0)
        if rot is not None and float(scaling if scaling is not None else 1.0) != 1.0:
            return "rotary attention_scaling != 1"
        if (rope_type != "default" or key is not None) and _inv_freq_buffer(rot, key) is None:
            # RopeTable's own formula is the default single table's
            return f"rope_type {rope_type!r} without the rotary module's inv_freq buffer"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    for layer in layers:
        if float(getattr(layer.self_attn, "attention_dropout", 0.0) or 0.0) != 0.0:
            return "attention dropout > 0"
        if any(getattr(layer._modules.get(n), "p", 0.0) for n in ("resid_attn_dropout", "resid_mlp_dropout")):
            return "residual dropout > 0"                                          # Phi-3's
    return None


def layer_windows(hf_model: nn.Module) -> list[int | None]:
    """Each decoder layer's sliding attention window, or None where the layer attends to every earlier
    column: the attention module's own ``sliding_window`` where it has one (Qwen 2 / 3 and Gemma 3
    give it to their ``sliding_attention`` layers only), else the config's (Mistral: every layer).

    transformers masks key column ``kv`` from query column ``q`` when ``kv <= q - window``, columns
    counted in the row's padded sequence (left padding included); the lean forward's masks do the
    same (``_attend_mask``, ``_group_attend_mask``)."""
    inner = hf_model.model
    cfg_window = getattr(hf_model.config, "sliding_window", None)
    windows = []
    for layer in inner.layers:
        attn = layer.self_attn
        w = attn.sliding_window if "sliding_window" in vars(attn) else cfg_window
        windows.append(None if w is None else int(w))
    return windows


def sliding_window(hf_model: nn.Module) -> int | None:
    """The narrowest sliding attention window of ``hf_model``'s layers (``layer_windows``), or None
    when every layer attends to every earlier column. Mistral 7B v0.1 and its fine-tunes have 4,096,
    Gemma 3's local layers 512; Qwen 2 has one only with ``use_sliding_window``."""
    windows = [w for w in layer_windows(hf_model) if w is not None] if hasattr(hf_model, "model") else []
    return min(windows) if windows else None


def peft_unsupported(model: nn.Module) -> str | None:
    """Only plain LoRA adapters act inside the wrapped modules; other peft types (prompt / prefix
    tuning) change the forward itself."""
    for name, cfg in getattr(model, "peft_config", {}).items():
        kind = str(getattr(getattr(cfg, "peft_type", None), "value", getattr(cfg, "peft_type", "")))
        if kind.upper() != "LORA":
            return f"peft adapter {name!r} is {kind}, not LoRA"
    return None


# ---------------------------------------------------------------------- rotary tables
class RopeTable:
    """cos / sin tables of a Llama's RoPE (the rotary module's ``inv_freq``: ``STATIC_ROPE``), cached
    per device / dtype / inverse-frequency buffer and grown to the longest position needed (the
    block size when the model has one)."""

    def __init__(self):
        self._tables: dict = {}

    def __call__(self, hf_model: nn.Module, positions: torch.Tensor, dtype: torch.dtype,
                 block_size: int | None, key: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, L, 1, D) in ``dtype`` for ``positions`` (B, L) (all < ``block_size``), from
        rotary table ``key`` (``layer_rope_types``; None: the model's one table).

        As transformers does: ``freqs = pos.float() * inv_freq`` in float32, ``emb = cat(freqs,
        freqs)``, cos / sin in float32, cast to the activations' dtype. ``sin`` is returned with its
        first half negated so that ``rotate_half(x) * sin == x.roll(D // 2, -1) * sin_signed``
        (exactly: negation is exact).
        """
        inv_freq = _inv_freq(hf_model, positions.device, key)
        dev = positions.device
        key = (dev, dtype, key, inv_freq.data_ptr(), inv_freq.dtype, inv_freq._version)
        tab = self._tables.get(key)
        need = block_size if block_size is not None else (int(positions.max()) + 1 if positions.numel() else 1)
        if tab is None or tab[0].size(0) < need:
            n = max(need, 64)
            f = inv_freq.to(device=dev, dtype=torch.float)
            freqs = torch.arange(n, device=dev, dtype=torch.long).float()[:, None] * f   # (n, D/2)
            cos_h, sin_h = freqs.cos(), freqs.sin()
            cos = torch.cat([cos_h, cos_h], dim=-1).to(dtype)
            sin = torch.cat([-sin_h, sin_h], dim=-1).to(dtype)
            self._tables = {k: v for k, v in self._tables.items() if k[:3] != key[:3]}  # stale
            tab = self._tables[key] = (cos, sin)
        cos, sin = tab
        return cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)


def layer_rope_types(hf_model: nn.Module) -> list[str | None]:
    """Each decoder layer's rotary table: None for all of them when the rotary module holds one
    table (``inv_freq``), else the layer's type (Gemma 3: ``sliding_attention`` layers rotate with
    base 10,000, ``full_attention`` ones with their own base and scaling: the module's
    ``{type}_inv_freq``)."""
    inner = hf_model.model
    n = len(inner.layers)
    rot = getattr(inner, "rotary_emb", None)
    if not getattr(rot, "layer_types", None):
        return [None] * n
    return list(hf_model.config.layer_types[:n])


def _inv_freq_buffer(rot: nn.Module | None, key: str | None) -> torch.Tensor | None:
    """The rotary module's inverse frequencies for table ``key`` (None: its one ``inv_freq``)."""
    return getattr(rot, "inv_freq" if key is None else f"{key}_inv_freq", None)


def _inv_freq(hf_model: nn.Module, device, key: str | None = None) -> torch.Tensor:
    """The model's rotary ``inv_freq`` buffer (D/2,) (table ``key``: ``layer_rope_types``), or the
    default-RoPE formula from its config."""
    rot = getattr(hf_model.model, "rotary_emb", None)
    inv_freq = _inv_freq_buffer(rot, key)
    if inv_freq is not None:
        return inv_freq
    cfg = hf_model.config  # pragma: no cover - stock Llama always has the buffer
    rope = getattr(cfg, "rope_parameters", None) or {}
    base = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))


# ---------------------------------------------------------------------- forward
def _attend_mask(full_am: torch.Tensor, past: int, L: int, window: int | None = None) -> torch.Tensor:
    """(B, L, S) bool, True = attend: key column j <= query column past+i (and, with a sliding
    ``window``, j > past+i - window), and the key is real or it is the query's own column (so no row
    is fully masked and pad queries stay finite)."""
    keym = full_am.bool()                                                        # (B, S)
    S = keym.size(1)
    if L == 1:
        mask = keym.clone()
        mask[:, -1] = True
        if window is not None and S > window:
            mask[:, :S - window] = False                                         # j <= (S - 1) - window
        return mask[:, None, :]                                                  # (B, 1, S)
    qcol = torch.arange(past, S, device=full_am.device)[:, None]                 # (L, 1)
    kcol = torch.arange(S, device=full_am.device)[None, :]                       # (1, S)
    seen = kcol <= qcol if window is None else (kcol <= qcol) & (kcol > qcol - window)
    return (keym[:, None, :] | (kcol == qcol)[None]) & seen[None]               # (B, L, S)


def _softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``tanh(x / cap) * cap`` (Gemma 2's attention scores and logits; transformers' order of ops),
    or ``x`` for no cap."""
    return x if cap is None else torch.tanh(x / cap) * cap


def _scores(addmask: torch.Tensor, q: torch.Tensor, kT: torch.Tensor, scaling: float,
            cap: float | None) -> torch.Tensor:
    """Attention scores ``addmask + q @ kT * scaling`` (one ``baddbmm``), soft-capped before the mask
    where the model caps them (``_softcap``, as transformers' eager attention)."""
    if cap is None:
        return torch.baddbmm(addmask, q, kT, alpha=scaling)
    return _softcap(torch.bmm(q, kT) * scaling, cap) + addmask


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
               addmask: torch.Tensor | None, sdpa_mask: torch.Tensor | None, cap: float | None = None) -> torch.Tensor:
    """q (B, H, L, D), k / v (B, Hkv, S, D) -> o (B, L, H * D): explicit products with ``addmask``
    (B*Hkv, rep*L, S) additive (scores soft-capped at ``cap``), else SDPA with ``sdpa_mask`` (B, 1, L, S)
    boolean (never with a cap: ``lean_forward`` builds additive masks for soft-capping models)."""
    B, H, L, D = q.shape
    Hkv, S = k.size(1), k.size(2)
    rep = H // Hkv
    if addmask is not None:
        # the rep query heads of a kv head attend to its keys as one batch: no head repeat
        s_ = _scores(addmask, q.reshape(B * Hkv, rep * L, D), k.reshape(B * Hkv, S, D).transpose(1, 2), scaling, cap)
        pr = torch.softmax(s_, dim=-1, dtype=torch.float32).to(v.dtype)
        o = torch.bmm(pr, v.reshape(B * Hkv, S, D))                              # (B*Hkv, rep*L, D)
    elif rep > 1 and L == 1:    # one query: group the heads as queries of their kv head
        o = F.scaled_dot_product_attention(q.reshape(B, Hkv, rep, D), k, v, attn_mask=sdpa_mask,
                                           scale=scaling)
    else:
        if rep > 1:
            k = k[:, :, None].expand(B, Hkv, rep, S, D).reshape(B, H, S, D)
            v = v[:, :, None].expand(B, Hkv, rep, S, D).reshape(B, H, S, D)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, scale=scaling)
    return o.reshape(B, H, L, D).transpose(1, 2).reshape(B, L, H * D)


def _group_attend_mask(full_am: torch.Tensor, prefix: int, G: int, past: int, L: int,
                       window: int | None = None) -> torch.Tensor:
    """(P, G, L, prefix + G * n) bool, True = attend, for the grouped layout (``LeanCache``): row g
    of prompt p, query i (its step ``past - prefix + i``) sees the prompt's real columns and, of the
    G * n step columns (step s, row g' at ``s * G + g'``), its own row's that are real or its own
    and not later. ``full_am`` (B, prefix + n) is the rows' mask (the same prompt columns in a group).
    A sliding ``window`` counts columns in each row's own sequence (the prompt's, then its steps:
    step s is column prefix + s), as transformers does for that row alone."""
    B, S = full_am.shape
    P, n = B // G, S - prefix
    keym = full_am.bool()
    pm = keym[::G, :prefix][:, None, None, :].expand(P, G, L, prefix)             # (P, G, L, prefix)
    qstep = torch.arange(past - prefix, n, device=full_am.device)[:, None]        # (L, 1)
    kstep = torch.arange(n, device=full_am.device)[None, :]                       # (1, n)
    seen = kstep <= qstep
    if window is not None:
        pcol = torch.arange(prefix, device=full_am.device)[None, :]               # (1, prefix)
        pm = pm & (pcol > prefix + qstep - window)                                # (P, G, L, prefix)
        seen = seen & (kstep > qstep - window)
    sm = (keym[:, prefix:].view(P, G, 1, n) | (kstep == qstep)) & seen            # (P, G, L, n)
    own = torch.eye(G, dtype=torch.bool, device=full_am.device)                    # (G, G')
    sm = (sm[..., None] & own[None, :, None, None, :]).reshape(P, G, L, n * G)    # column s * G + g'
    return torch.cat([pm, sm], dim=-1)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as scores to add: 0 where True, -inf where False."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _group_addmask(gmask: torch.Tensor, Hkv: int, rep: int, dtype: torch.dtype) -> torch.Tensor:
    """(P, G, Lc, S) bool -> (P * Hkv, G * Lc * rep, S) additive mask (0 or -inf) of grouped scores."""
    P, G, Lc, S = gmask.shape
    return _additive(gmask, dtype)[:, None, :, :, None].expand(P, Hkv, G, Lc, rep, S).reshape(P * Hkv, G * Lc * rep, S)


def _group_chunks(gmask: torch.Tensor, Hkv: int, rep: int, dtype: torch.dtype) -> list[tuple]:
    """The query chunks (first, count, additive mask or None) of grouped attention: at most about
    ``GROUP_SCORES`` score elements each; a single chunk (a decode step) gets its mask built here,
    once for every layer, more are built per layer (``_grouped_attention``) to bound memory."""
    P, G, L, S = gmask.shape
    step = max(1, GROUP_SCORES // max(1, P * Hkv * G * rep * S))
    if step >= L:
        return [(0, L, _group_addmask(gmask, Hkv, rep, dtype))]
    return [(i, min(step, L - i), None) for i in range(0, L, step)]


def _grouped_attention(q: torch.Tensor, kT: torch.Tensor, v: torch.Tensor, gmask: torch.Tensor,
                       chunks: list[tuple], scaling: float, cap: float | None = None) -> torch.Tensor:
    """Attention in the grouped layout: q (B, L, H, D) rotated queries, kT (P, Hkv, D, S) and v
    (P, Hkv, S, D) a prompt's columns (``LeanCache``'s grouped layout), gmask (P, G, L, S) from
    ``_group_attend_mask``, its ``_group_chunks`` -> o (B, L, H * D). The G rows x L queries x rep
    heads of a kv head form one (G * L * rep, D) @ (D, S) product per (prompt, kv head) and query
    chunk."""
    B, L, H, D = q.shape
    P, Hkv, _, S = kT.shape
    G, rep = B // P, H // Hkv
    q6 = q.reshape(P, G, L, Hkv, rep, D).permute(0, 3, 1, 2, 4, 5)                # (P, Hkv, G, L, rep, D)
    kT = kT.reshape(P * Hkv, D, S)                                                 # (P*Hkv, D, S)
    vv = v.reshape(P * Hkv, S, D)
    outs = []
    for i, Lc, add in chunks:
        if add is None:
            add = _group_addmask(gmask[:, :, i:i + Lc], Hkv, rep, q.dtype)
        qc = q6[:, :, :, i:i + Lc].reshape(P * Hkv, G * Lc * rep, D)
        s_ = _scores(add, qc, kT, scaling, cap)                                   # (P*Hkv, G*Lc*rep, S)
        pr = torch.softmax(s_, dim=-1, dtype=torch.float32).to(v.dtype)
        o = torch.bmm(pr, vv).view(P, Hkv, G, Lc, rep, D)
        outs.append(o.permute(0, 2, 3, 1, 4, 5).reshape(B, Lc, H * D))             # (B, Lc, H*D)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


HEAD_CHUNK = 1024
"""Without gradient and with at most ``HEAD_ROWS`` rows (a decode step), the output head is
computed in blocks of this many vocabulary rows written into one output: each block's weights and
outputs stay in cache (measured ~1.3x faster than one (rows, V) product at V = 49,152, 64 rows). On
CPU a block is computed weight-major (``W_block @ x.T``, as ``linear_t``) and transposed into place
from cache: SmolLM2's 64-row sampling took 0.975x the time (median of 12 paired runs), its
log-probs equal to float rounding (2.5e-5 apart)."""
HEAD_ROWS = 256
"""The most rows a no-gradient call computes the head in blocks and its projections weight-major for
(``output_head``, ``_weight_major``): decode steps and small prefills."""
PACK_ROWS = 64
"""The row count oneDNN lays a prepacked bf16 weight out for (``_Bf16Weights.packed``): one pack
serves the head at every row count up to ``HEAD_ROWS``. The layout it picks changes how some products round:
packs made for 64 rows gave F.linear's bits at 1-256 rows on SmolLM2's shapes, packs made for 1
row differed from 36 rows on, for 8 or 256 rows at 96 rows on one shape (a 2-core Xeon with AMX),
so ``_packed_linear_ok`` probes a pack made for this many."""


def rms_norm(norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``norm(h)`` for a Llama RMSNorm, through torch's fused ``F.rms_norm`` when h is float32 (the
    same numbers: x * rsqrt(mean(x^2) + eps) * weight, fewer kernel calls); else the module itself."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None or h.dtype != torch.float32 or norm.weight.dtype != torch.float32:
        return norm(h)
    return F.rms_norm(h, (h.size(-1),), norm.weight, eps)


def output_head(head: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``head(h)`` (..., V); a plain bias-free Linear on few rows without gradient or autocast is
    computed in ``HEAD_CHUNK`` vocabulary blocks (the same products, a cache-sized working set;
    weight-major on CPU). Under CPU bf16 autocast it is one bf16 product (``linear``): blocks and a
    weight-major product measured no faster there once the logits are converted to float32."""
    rows = h.numel() // h.size(-1)
    if type(head) is not nn.Linear or head.bias is not None or torch.is_grad_enabled() or rows > HEAD_ROWS:
        return linear(head, h)
    # 2-D: after weight-major layers a (B, 1, d) h has an odd stride on its size-1 dim, which sends
    # a 3-D F.linear to a batched product over a copy of the head expanded to every row (GBs)
    x = h.reshape(rows, h.size(-1))                                              # (rows, d)
    if h.dtype != head.weight.dtype or torch.is_autocast_enabled(h.device.type):
        out = _packed_head(head, x)
        return (linear(head, x) if out is None else out).view(*h.shape[:-1], -1)
    W = head.weight                                                              # (V, d)
    out = x.new_empty(rows, W.size(0))                                           # (rows, V)
    if h.device.type == "cpu":  # weight-major blocks (see linear_t), each transposed into place from cache
        xT, block = x.t(), x.new_empty(HEAD_CHUNK, rows)
        for i in range(0, W.size(0), HEAD_CHUNK):
            n = min(HEAD_CHUNK, W.size(0) - i)
            torch.mm(W[i:i + n], xT, out=block[:n])
            out[:, i:i + n].copy_(block[:n].t())
    else:
        for i in range(0, W.size(0), HEAD_CHUNK):
            torch.mm(x, W[i:i + HEAD_CHUNK].t(), out=out[:, i:i + HEAD_CHUNK])
    return out.view(*h.shape[:-1], W.size(0))


# ---------------------------------------------------------------------- bf16 weights under autocast
_SCOPE = threading.local()


def _stamp(ws: tuple[torch.Tensor | None, ...]) -> tuple:
    """What tells that a weight is unchanged: its version counter (every in-place op and
    ``load_state_dict`` bump it) and data pointer (``p.data = ...`` moves it); -1 for None."""
    return tuple(-1 if w is None else (w._version, w.data_ptr()) for w in ws)


class _Copies:
    """Tensors made from weights (bf16 copies, stacks, packs) keyed by a kind and the weights' ids,
    each served while its weights are the same objects, unchanged (``_stamp``). ``weak``: the
    weights are held by weak references, so that an entry goes with its weights (the store of
    copies kept across regions); else by strong ones (one region's store)."""

    def __init__(self, weak: bool):
        self.weak = weak
        self.entries: dict[tuple, tuple[tuple, tuple, torch.Tensor]] = {}

    def find(self, kind: str, ws: tuple[torch.Tensor | None, ...]) -> torch.Tensor | None:
        hit = self.entries.get((kind,) + tuple(map(id, ws)))
        if hit is None:
            return None
        refs, stamp, made = hit
        same = all((r is None) if w is None else (r is not None and (r() if self.weak else r) is w)
                   for r, w in zip(refs, ws))
        return made if same and stamp == _stamp(ws) else None

    def put(self, kind: str, ws: tuple[torch.Tensor | None, ...], made: torch.Tensor) -> torch.Tensor:
        key = (kind,) + tuple(map(id, ws))
        if self.weak:
            entries = self.entries
            refs = tuple(None if w is None else weakref.ref(w, lambda _r, k=key: entries.pop(k, None)) for w in ws)
        else:
            refs = tuple(ws)
        self.entries[key] = (refs, _stamp(ws), made)
        return made

    def clear(self) -> None:
        self.entries.clear()


_KEPT = _Copies(weak=True)
"""bf16 copies, stacks and packs of frozen weights (``requires_grad`` False: a LoRA policy's base,
a reference model), kept from one ``bf16_weights()`` region to the next while the weights live
unchanged: a LoRA run's base weights never change, so each sampling call and training forward
would otherwise copy all of them again (SmolLM2: 270 MB written a region) and pack the head again."""


def drop_kept_copies() -> None:
    """Free the bf16 copies kept across regions (``_KEPT``); the next region makes them again. For a
    caller that changes a frozen weight through ``.data`` in place, which no version counter sees."""
    _KEPT.clear()


def _plan_parts(mods: tuple[nn.Module, ...]) -> tuple[tuple[nn.Module, ...], tuple[torch.Tensor, ...]]:
    """(the modules a decode plan of ``mods`` calls or reads: each module and, of a peft LoRA Linear,
    its base layer and every factor; their weights and biases)."""
    subs: list[nn.Module] = []
    for m in mods:
        subs.append(m)
        if "base_layer" in m._modules:
            subs.append(m.base_layer)
            for factors in (m._modules.get("lora_A"), m._modules.get("lora_B")):
                subs.extend(factors.values() if factors is not None else ())
    tensors = tuple(t for sub in subs if type(sub) is nn.Linear for t in (sub.weight, sub.bias) if t is not None)
    return tuple(subs), tensors


def _plan_state(mods: tuple[nn.Module, ...], subs: tuple[nn.Module, ...], tensors: tuple[torch.Tensor, ...]) -> tuple:
    """What a decode plan of ``mods`` rests on besides its weights' values (``_Bf16Weights.decode_plan``):
    global and ``subs``' forward hooks, the tensors' ``requires_grad``, the modules' train mode, and
    each peft LoRA Linear's adapter state (disabled, merged, active adapters, scalings)."""
    g = nn.modules.module
    return ((bool(g._global_forward_hooks or g._global_forward_pre_hooks),)
            + tuple((bool(sub._forward_hooks or sub._forward_pre_hooks), sub.training) for sub in subs)
            + tuple(t.requires_grad for t in tensors)
            + tuple(_adapter_state(m) for m in mods if "base_layer" in m._modules))


def _adapter_state(m: nn.Module) -> tuple:
    """A peft tuner layer's adapter state (disabled, merged, active adapters, LoRA scalings), each
    None where the layer has no such attribute (a tuner other than LoRA, which ``_plain_lora`` runs
    as a module)."""
    scaling = getattr(m, "scaling", None)
    active = getattr(m, "active_adapters", None)
    return (getattr(m, "disable_adapters", None), getattr(m, "merged", None),
            None if active is None else tuple(active),
            tuple(scaling.items()) if isinstance(scaling, dict) else scaling)


class _Bf16Weights:
    """bf16 copies of weights for one ``bf16_weights()`` region: those of frozen weights from (and
    into) the store kept across regions (``_KEPT``), the others made in the region and freed at
    its end."""

    def __init__(self):
        self.region = _Copies(weak=False)
        self.plans: dict[tuple, tuple] = {}
        """``decode_plan``'s entries."""

    def decode_plan(self, mods: tuple[nn.Module, ...], rows: int, make):
        """``make(self, mods, rows)``: what ``linear`` / ``_stacked_linear`` read for ``mods`` in a
        no-gradient decode step (copies, packs, LoRA factors, or None: the module runs itself), made
        at the first step of a region and served to its later steps while the modules are the same
        objects, their weights unchanged (``_stamp``) and nothing else it rests on changed
        (``_plan_state``: hooks, requires_grad, a LoRA Linear's adapter state). Making it looks each
        copy and pack up again (several Python calls a weight): on SmolLM2 with LoRA (2-core Xeon
        with AMX) that took 41 us a call for o_proj / down_proj and 77 for a stacked q/k/v or
        gate/up, about 8 ms of a 64-row decode step, in each step."""
        key = (make, tuple(map(id, mods)), rows)
        hit = self.plans.get(key)
        if hit is not None:
            held, subs, tensors, stamp, state, made = hit
            if (all(a is b for a, b in zip(held, mods)) and _stamp(tensors) == stamp
                    and _plan_state(mods, subs, tensors) == state):
                return made
        subs, tensors = _plan_parts(mods)
        made = make(self, mods, rows)
        self.plans[key] = (mods, subs, tensors, _stamp(tensors), _plan_state(mods, subs, tensors), made)
        return made

    def made(self, kind: str) -> set[tuple[int, ...]]:
        """The weight ids of every ``kind`` entry this region would serve (its own, and the kept
        ones whose weights live unchanged): "copy", "stack", "bias stack", f"pack {rows}"."""
        out = set()
        if "pack" in kind and not _packed_linear_ok():    # packs serve only where oneDNN's do
            return out
        for store in (self.region, _KEPT):
            for key, (refs, stamp, _) in list(store.entries.items()):
                ws = tuple(None if r is None else (r() if store.weak else r) for r in refs)
                if key[0] == kind and all((w is None) == (r is None) for w, r in zip(ws, refs)) and stamp == _stamp(ws):
                    out.add(key[1:])
        return out

    def _store(self, ws: tuple[torch.Tensor | None, ...]) -> _Copies:
        return _KEPT if all(w is None or not w.requires_grad for w in ws) else self.region

    def _own(self, W: torch.Tensor) -> torch.Tensor | None:
        return self._store((W,)).find("copy", (W,))

    def get(self, W: torch.Tensor) -> torch.Tensor | None:
        """W's bf16 copy, made at its first use (in the region, or kept from an earlier one for a
        frozen W) and made again if W changed since (``_stamp``); None where a copy would not serve:
        W needs a gradient here, or is not a float32 CPU tensor."""
        if (W.requires_grad and torch.is_grad_enabled()) or W.dtype != torch.float32 or W.device.type != "cpu":
            return None
        hit = self._own(W)
        return hit if hit is not None else self._store((W,)).put("copy", (W,), W.detach().to(torch.bfloat16))

    def stacked(self, ws: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """The bf16 copies of ``ws`` (each (N_i, K)) stacked by rows, (sum N_i, K): one product for
        several weights that read the same input (``_stacked_t_bf16``). Each weight's own copy then
        becomes its row block of the stack (a view), so no weight is held twice; made again where a
        weight changed. None where a copy would not serve (``get``)."""
        store = self._store(ws)
        hit = store.find("stack", ws)
        if hit is not None:
            return hit
        if (any((w.requires_grad and torch.is_grad_enabled()) or w.dtype != torch.float32 or w.device.type != "cpu"
                or w.dim() != 2 for w in ws) or len({w.size(1) for w in ws}) != 1):
            return None
        stack = torch.empty(sum(w.size(0) for w in ws), ws[0].size(1), dtype=torch.bfloat16)  # (sum N_i, K)
        row = 0
        for w in ws:
            block = stack[row:row + w.size(0)]
            own = self._own(w)
            block.copy_(own if own is not None else w.detach())
            self._store((w,)).put("copy", (w,), block)
            row += w.size(0)
        return store.put("stack", ws, stack)

    def stacked_bias(self, bs: tuple[torch.Tensor | None, ...], sizes: tuple[int, ...]) -> torch.Tensor | None:
        """The bf16 copies of the biases ``bs`` (each (sizes[i],), or None: zeros) end to end,
        (sum sizes,): the bias of a ``stacked`` product. Made again where a bias changed; None where
        a copy would not serve (``get``)."""
        store = self._store(bs)
        hit = store.find("bias stack", bs)
        if hit is not None:
            return hit
        copies = [None if b is None else self.get(b) for b in bs]
        if any(c is None and b is not None for b, c in zip(bs, copies)):
            return None
        stack = torch.cat([torch.zeros(n, dtype=torch.bfloat16) if c is None else c for c, n in zip(copies, sizes)])
        return store.put("bias stack", bs, stack)

    def packed(self, W: torch.Tensor, rows: int) -> torch.Tensor | None:
        """W's bf16 copy reordered into oneDNN's blocked weight layout (``_linear_pointwise``
        computes ``x @ W.T`` from it without reordering W at every call; the same products), laid
        out for ``rows`` rows (any row count may use it: on SmolLM2's head at 8 and at 64 rows the
        times were within 10% whichever of 1, 8, 64 or 256 it was made for); None where a copy
        would not serve or oneDNN's bf16 linear is unavailable (``_packed_linear_ok``)."""
        if (W.requires_grad and torch.is_grad_enabled()) or W.dtype != torch.float32 or W.device.type != "cpu":
            return None
        if not _packed_linear_ok():
            return None
        store = self._store((W,))
        kind = f"pack {rows}"
        hit = store.find(kind, (W,))
        if hit is not None:
            return hit
        own = self._own(W)
        Wb = own if own is not None else W.detach().to(torch.bfloat16)
        return store.put(kind, (W,), torch.ops.mkldnn._reorder_linear_weight(Wb, rows))


    def packed_stack(self, ws: tuple[torch.Tensor, ...], rows: int) -> torch.Tensor | None:
        """The ``stacked`` bf16 copy of ``ws`` (each (N_i, K)) reordered into oneDNN's blocked layout for
        ``rows`` rows (as ``packed``): one prepacked product for several frozen weights that read the
        same input (``_stacked_linear``). Kept across regions with the weights; None where a stack or a
        pack would not serve (a weight needs a gradient here, oneDNN's packed linear is unavailable)."""
        if not _packed_linear_ok() or any(w.requires_grad and torch.is_grad_enabled() for w in ws):
            return None
        store, kind = self._store(ws), f"stack pack {rows}"
        hit = store.find(kind, ws)
        if hit is not None:
            return hit
        stack = self.stacked(ws)
        return None if stack is None else store.put(kind, ws, torch.ops.mkldnn._reorder_linear_weight(stack, rows))


_PACKED_OK: list[bool] = []


def _packed_linear_ok() -> bool:
    """Whether this torch has oneDNN's prepacked bf16 linear (``torch.ops.mkldnn._reorder_linear_weight``
    / ``_linear_pointwise``) and it gives ``F.linear``'s bf16 products to the last bit, with and
    without a bias, on a probe of SmolLM2's MLP shape at 1 to 200 rows from a pack made for
    ``PACK_ROWS`` (as decode uses one pack at every row count up to ``HEAD_ROWS``); checked once per
    process."""
    if not _PACKED_OK:
        ok = False
        try:
            if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
                gen = torch.Generator().manual_seed(0)
                W = torch.randn(1536, 576, generator=gen).to(torch.bfloat16)
                b = torch.randn(1536, generator=gen).to(torch.bfloat16)
                packed = torch.ops.mkldnn._reorder_linear_weight(W, PACK_ROWS)
                ok = True
                for rows in (1, 8, 64, 96, 200):
                    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
                    ok = ok and torch.equal(_packed_linear(x, packed, None), F.linear(x, W))
                    ok = ok and torch.equal(_packed_linear(x, packed, b), F.linear(x, W, b))
        except (AttributeError, RuntimeError, NotImplementedError):
            ok = False
        _PACKED_OK.append(ok)
    return _PACKED_OK[0]


def decode_reads_packs() -> bool:
    """Whether bf16 decode steps on this CPU read every frozen weight from a prepacked copy kept
    with its bf16 copy (``linear``): where decode's products run row-major (``_weight_major_bf16_ok``
    fails) and oneDNN's packed linear serves (``_packed_linear_ok``). Elsewhere only the head is packed."""
    return _packed_linear_ok() and not _weight_major_bf16_ok()


def _packed_linear(x: torch.Tensor, Wp: torch.Tensor, bb: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T (+ bb)`` (rows, N) for a bf16 x (rows, K) from W's prepacked bf16 copy ``Wp``."""
    return torch.ops.mkldnn._linear_pointwise(x, Wp, bb, "none", [], "")


_PACK_OK_AT: dict[tuple, bool] = {}


def _pack_ok(Wp: torch.Tensor, Wbs: tuple[torch.Tensor, ...], bbs: tuple[torch.Tensor | None, ...], rows: int) -> bool:
    """Whether a product on ``rows`` rows from ``Wp``, the prepacked (``PACK_ROWS``) bf16 weights
    ``Wbs`` (each (N_i, K); several stacked, ``_Bf16Weights.packed_stack``), gives each weight's
    ``F.linear`` bf16 product (with its bf16 bias ``bbs[i]``, the stack's bias 0 where None) to the
    last bit: autocast's numbers. oneDNN picks its kernel, and so its order of summation, by the
    shapes, and a pack's product may take another than ``F.linear`` at some row counts: on a 2-core
    Xeon with AMX, one weight of 192 x 576 (SmolLM2's k or v) at 96 rows of 1-256, one of 128 x 896
    (Qwen2.5-0.5B's) at 30 of them, and SmolLM2's q/k/v stacked (960 x 576) from 192 rows on,
    while its o, gate/up, down and head products and Qwen's q/k/v stacked below 128 rows gave the
    bits. So each (shapes, biases, rows) is probed once per process on the weights at hand and a
    random input (two products); where it fails the caller computes ``F.linear``. A probe costs two
    products at that row count: about 5 ms for SmolLM2's head, 31-61 ms for Qwen2.5-0.5B's 151,936 x
    896 one (12-64 rows), paid once for each row count a run's decode steps reach (live rows vary)."""
    key = (tuple(W.size(0) for W in Wbs), Wbs[0].size(1), rows, tuple(b is not None for b in bbs))
    ok = _PACK_OK_AT.get(key)
    if ok is None:
        x = torch.randn(rows, key[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        bias = (torch.cat([torch.zeros(W.size(0), dtype=torch.bfloat16) if b is None else b for W, b in zip(Wbs, bbs)])
                if any(key[3]) else None)
        want = torch.cat([F.linear(x, W, b) for W, b in zip(Wbs, bbs)], dim=1)
        ok = _PACK_OK_AT[key] = torch.equal(_packed_linear(x, Wp, bias), want)
    return ok


def _stacked_plan(scope: "_Bf16Weights", mods: tuple[nn.Module, ...], rows: int) -> tuple | None:
    """(the stacked pack, its stacked bias or None, each module's output width, [(base weight, base
    bias, [(A, B, scaling), ...]) per module]) that ``_stacked_linear`` reads for ``mods`` at
    ``rows`` rows, or None where it does not serve (see there)."""
    plans = []
    for m in mods:
        plan = (m.weight, m.bias, []) if type(m) is nn.Linear and not _hooked(m) else _plain_lora(m, torch.float32)
        if plan is None or plan[0].requires_grad or (plan[1] is not None and plan[1].requires_grad):
            return None
        plans.append(plan)
    ws, bs = tuple(W for W, _, _ in plans), tuple(b for _, b, _ in plans)
    sizes = tuple(W.size(0) for W in ws)
    Wp = scope.packed_stack(ws, PACK_ROWS)
    bb = scope.stacked_bias(bs, sizes) if any(b is not None for b in bs) else None
    if Wp is None or (bb is None and any(b is not None for b in bs)):
        return None
    if not _pack_ok(Wp, tuple(map(scope.get, ws)), tuple(None if b is None else scope.get(b) for b in bs), rows):
        return None
    return Wp, bb, sizes, plans


def _stacked_linear(mods: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor] | None:
    """``[linear(m, x) for m in mods]`` for modules that read the same ``x`` (..., K) (q/k/v; gate/up)
    in a row-major bf16 decode step (``decode_reads_packs``: no gradient, at most ``HEAD_ROWS`` rows,
    CPU bf16 autocast in a ``bf16_weights()`` region), from ONE product with the prepacked stack of
    their frozen base weights (``_Bf16Weights.packed_stack``, kept across regions), each output a
    column block of it; LoRA terms then added per module as ``linear`` adds them (the factors under
    autocast, as peft calls them). The same bits as ``linear``'s products where ``_pack_ok`` says
    the stacked product gives them; None elsewhere (a module not a plain Linear or plain LoRA
    Linear, a base weight that trains, no pack): the caller runs ``linear``. On SmolLM2 with LoRA
    r = 16 at 64 rows (2-core Xeon with AMX) the bare products of the 30 layers took 12.8 ms a step
    stacked, but with the LoRA terms and the per-call bookkeeping a decode step's products took 36.0
    against 37.1 ms (median of ten alternated), and a whole sampling call 1.090 against 1.127 s."""
    scope = getattr(_SCOPE, "weights", None)
    rows = x.numel() // x.size(-1)
    if (scope is None or torch.is_grad_enabled() or rows > HEAD_ROWS or not _cpu_bf16_autocast(x.device)
            or not decode_reads_packs()):
        return None
    plan = scope.decode_plan(mods, rows, _stacked_plan)
    if plan is None:
        return None
    Wp, bb, sizes, plans = plan
    out = _packed_linear(x.reshape(rows, x.size(-1)).to(torch.bfloat16), Wp, bb)   # (rows, sum N)
    outs = []
    for block, (_, _, adapters) in zip(out.split(sizes, dim=1), plans):
        block = block.view(*x.shape[:-1], block.size(1))
        for A, B, scaling in adapters:   # as linear adds them: x cast by autocast, as peft calls them
            block = block + F.linear(F.linear(x, A), B) * scaling
        outs.append(block)
    return outs


@contextlib.contextmanager
def bf16_weights():
    """A region in which the lean forward's products under CPU bf16 autocast read each weight that
    needs no gradient from a bf16 copy made once in the region (``linear``), instead of casting it
    again at every call: torch.autocast caches its casts of leaf tensors that require grad only, so
    the frozen base weights of a LoRA policy are cast anew for every product, and a SmolLM2 sampling
    call (16 forwards) spent about a quarter of its time on those casts. rlvr.run's autocast context
    opens one around every sampling call and training forward; nested regions share the outer's
    copies. The copies of weights that train are freed at the end of the outermost region; those of
    frozen weights are kept for later regions (``_KEPT``; 2 bytes per weight, 4 with a pack)."""
    outer = getattr(_SCOPE, "weights", None)
    if outer is None:
        _SCOPE.weights = _Bf16Weights()
    try:
        yield
    finally:
        if outer is None:
            _SCOPE.weights = None


def _cpu_bf16_autocast(device: torch.device) -> bool:
    """Whether torch.autocast to bf16 is on for ``device``, a CPU."""
    return (device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16)


def _bf16_copy(W: torch.Tensor) -> torch.Tensor | None:
    """W's bf16 copy in the current ``bf16_weights()`` region (``_Bf16Weights.get``); None outside one."""
    scope = getattr(_SCOPE, "weights", None)
    return None if scope is None else scope.get(W)


def _packed_head(head: nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """``head(x)`` (rows, V) for x (rows, d) under CPU bf16 autocast inside ``bf16_weights()``
    without gradient, from the head's prepacked bf16 copy (``_Bf16Weights.packed``): the bf16
    product autocast computes, equal to the last bit (probed, and tested); on SmolLM2's head (49,152
    x 576) at 64 rows 9.3 ms against 12.9 for ``F.linear`` on the plain copy, which reorders the
    weight at every call. None elsewhere."""
    scope = getattr(_SCOPE, "weights", None)
    if scope is None or not _cpu_bf16_autocast(x.device) or torch.is_grad_enabled() or _hooked(head):
        return None
    Wp = scope.packed(head.weight, PACK_ROWS)
    if Wp is None or not _pack_ok(Wp, (scope.get(head.weight),), (None,), x.size(0)):
        return None
    return _packed_linear(x.to(torch.bfloat16), Wp, None)


def _linear_plan(scope: "_Bf16Weights", mods: tuple[nn.Module], rows: int) -> tuple | None:
    """(W's bf16 copy, its bias's or None, W's prepacked copy where a no-gradient call on ``rows`` rows
    reads it, else None; the LoRA adapters [(A, B, scaling), ...]) that ``linear`` computes
    ``mods[0]`` from, or None where the module runs itself (hooks, not a plain Linear or plain LoRA
    Linear, a weight that needs a gradient here)."""
    m = mods[0]
    if _hooked(m):
        return None
    lora = (m.weight, m.bias, []) if type(m) is nn.Linear else _plain_lora(m, torch.float32)
    if lora is None:
        return None
    W, b, adapters = lora
    Wb, bb = scope.get(W), None if b is None else scope.get(b)
    if Wb is None or (b is not None and bb is None):
        return None
    Wp = (scope.packed(W, PACK_ROWS) if not W.requires_grad and not torch.is_grad_enabled() and rows <= HEAD_ROWS
          else None)
    return Wb, bb, Wp if Wp is not None and _pack_ok(Wp, (Wb,), (bb,), rows) else None, adapters


def linear(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``m(x)``; inside ``bf16_weights()`` under bf16 autocast on the CPU, an ``nn.Linear`` (or a
    plain peft LoRA ``Linear``'s base layer, see ``_plain_lora``) takes its weight and bias from the
    region's bf16 copies when they need no gradient: what autocast computes (the input cast to bf16,
    a bf16 product with the bf16 bias; LoRA factors under autocast as peft calls them), equal to the
    last bit (tested). Without gradient on at most ``HEAD_ROWS`` rows (row-major decode steps) a
    frozen weight (``_KEPT``: packed once, kept across regions) is read from its prepacked copy
    (``_packed_linear``, where ``_packed_linear_ok`` and ``_pack_ok`` at these rows say it gives the
    same bits; ``_stacked_linear`` reads q/k/v and gate/up from stacked packs): on a 2-core Xeon with AMX 1.3x
    faster products a layer at 64 rows; packed again in every region (a weight that trains) it left
    a whole sampling call no faster (2.62 s against 2.47 s, median of six alternated). (Casting
    each input once for every product that reads it and the LoRA factors from bf16 copies, without
    gradient, gave the same bits and no faster call: 3.76 s against 3.68 s, median of 12 alternated.)"""
    scope = getattr(_SCOPE, "weights", None)
    if (scope is None or x.device.type != "cpu" or not torch.is_autocast_enabled("cpu")
            or torch.get_autocast_dtype("cpu") != torch.bfloat16):
        return m(x)
    rows = x.numel() // x.size(-1)
    plan = (scope.decode_plan((m,), rows, _linear_plan) if rows <= HEAD_ROWS and not torch.is_grad_enabled()
            else _linear_plan(scope, (m,), rows))
    if plan is None:
        return m(x)
    Wb, bb, Wp, adapters = plan
    if Wp is not None:
        out = _packed_linear(x.reshape(rows, x.size(-1)).to(torch.bfloat16), Wp, bb).view(*x.shape[:-1], -1)
    else:
        out = F.linear(x.to(torch.bfloat16), Wb, bb)
    for A, B, scaling in adapters:     # x cast again by autocast, as peft calls it: the same gradient sums
        out = out + F.linear(F.linear(x, A), B) * scaling
    return out


_MLP_TYPES: list[type] = []


def _stock_mlp(mlp: nn.Module) -> bool:
    """Whether ``mlp`` is a stock MLP of a ``lean_families`` model (``down(act(gate(x)) * up(x))``)."""
    if not _MLP_TYPES:
        _MLP_TYPES.extend(fam[3] for fam in lean_families().values())
    return type(mlp) in _MLP_TYPES


def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``mlp(x)``: a stock MLP's products through ``linear``."""
    if not _stock_mlp(mlp) or _hooked(mlp):
        return mlp(x)
    mods = _gate_up_mods(mlp)
    parts = _stacked_linear(mods, x) or [linear(m, x) for m in mods]
    g, u = parts if len(parts) == 2 else parts[0].chunk(2, dim=-1)
    return linear(mlp.down_proj, _act(mlp)(g) * u)


def _qkv_mods(attn: nn.Module) -> tuple[nn.Module, ...]:
    """An attention's q/k/v projections: (q_proj, k_proj, v_proj), or Phi-3's fused (qkv_proj,), whose
    output rows are q's, then k's, then v's."""
    return (attn.qkv_proj,) if "qkv_proj" in attn._modules else (attn.q_proj, attn.k_proj, attn.v_proj)


def _gate_up_mods(mlp: nn.Module) -> tuple[nn.Module, ...]:
    """A gated MLP's gate and up projections: (gate_proj, up_proj), or Phi-3's fused (gate_up_proj,),
    whose output rows are the gate's, then up's."""
    return (mlp.gate_up_proj,) if "gate_up_proj" in mlp._modules else (mlp.gate_proj, mlp.up_proj)


def _act(mlp: nn.Module) -> nn.Module:
    """A gated MLP's activation module (``act_fn``; Phi-3's ``activation_fn``)."""
    return mlp.act_fn if "act_fn" in mlp._modules else mlp.activation_fn


# ---------------------------------------------------------------------- weight-major products
def _lora_linear_type():
    """peft's LoRA ``Linear`` class, or None without peft."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # pragma: no cover - peft is in the hf extra
        return None
    return Linear


def _hooked(m: nn.Module) -> bool:
    """Whether calling ``m`` would run forward hooks (its own or global ones): then it is called."""
    g = nn.modules.module
    return bool(m._forward_hooks or m._forward_pre_hooks or g._global_forward_hooks
                or g._global_forward_pre_hooks)


def _plain_lora(m: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, list] | None:
    """(base weight (N, K), base bias (N,) or None, [(lora_A weight (r, K), lora_B weight (N, r),
    scaling), ...]) of a peft LoRA ``Linear`` that computes exactly ``base(x) + sum over active
    adapters of lora_B(lora_A(x)) * scaling`` here: not merged, adapters enabled, nn.Linear base (its
    bias, if any, in ``dtype``) and bias-free factors in ``dtype``, no DoRA or other variant, no
    dropout acting, no forward hooks. None for anything else (the caller then runs the module)."""
    lora_t = _lora_linear_type()
    if lora_t is None or type(m) is not lora_t or m.disable_adapters or m.merged or _hooked(m):
        return None
    base = m.base_layer
    if (type(base) is not nn.Linear or base.weight.dtype != dtype or _hooked(base)
            or (base.bias is not None and base.bias.dtype != dtype)):
        return None
    adapters = []
    for name in m.active_adapters:
        if name not in m.lora_A:
            continue
        if name in getattr(m, "lora_variant", {}) or getattr(m, "use_dora", {}).get(name, False):
            return None
        A, B, drop = m.lora_A[name], m.lora_B[name], m.lora_dropout[name]
        if (type(A) is not nn.Linear or type(B) is not nn.Linear or A.bias is not None or B.bias is not None
                or A.weight.dtype != dtype or B.weight.dtype != dtype or _hooked(A) or _hooked(B)
                or not (type(drop) is nn.Identity or not drop.training)):
            return None
        adapters.append((A.weight, B.weight, m.scaling[name]))
    return base.weight, base.bias, adapters


def linear_t(m: nn.Module, xT: torch.Tensor) -> torch.Tensor:
    """``m(xT.t()).t()``: (N, rows) from (K, rows), for few rows without gradient.

    An ``nn.Linear`` (or a plain peft LoRA ``Linear``, see ``_plain_lora``) is computed as
    ``W @ xT`` (``b + W @ xT`` in one ``addmm`` with a bias, as ``F.linear`` adds it; then
    ``+ B @ (A @ xT) * scaling`` per adapter, peft's order; one ``addmm`` when the scaling is a power
    of two, where scaling the product is exact): on CPU at decode's row
    counts BLAS (MKL here) runs this weight-major product faster than ``x @ W.T``: 0.74-0.86x the
    time at 16-64 rows on SmolLM2's shapes, 0.96x at 256, 1.0x at 1,024; the same sums, equal to the
    last bit at 1 and at 12-256 rows there (MKL rounds 2-11 rows differently), and its (N, rows)
    output feeds the next weight-major product without a copy. Anything else (a module with forward
    hooks included, so that hooks see every call) runs the module and transposes its output (a view).

    A bf16 ``xT`` (under CPU bf16 autocast, ``_weight_major``) takes ``_linear_t_bf16``."""
    if xT.dtype == torch.bfloat16:
        return _linear_t_bf16(m, xT)
    if (type(m) is nn.Linear and m.weight.dtype == xT.dtype and not _hooked(m)
            and (m.bias is None or m.bias.dtype == xT.dtype)):
        return _mm_bias(m.weight, m.bias, xT)
    lora = _plain_lora(m, xT.dtype)
    if lora is None:
        return m(xT.t()).t()
    W, b, adapters = lora
    out = _mm_bias(W, b, xT)                                                     # (N, rows)
    for A, B, scaling in adapters:
        if math.frexp(scaling)[0] == 0.5:  # a power of two: B @ (A @ xT) * scaling is exact, one call
            out = torch.addmm(out, B, torch.mm(A, xT), alpha=scaling)
        else:
            out = out + torch.mm(B, torch.mm(A, xT)) * scaling
    return out


def _mm_bias(W: torch.Tensor, b: torch.Tensor | None, xT: torch.Tensor) -> torch.Tensor:
    """``W @ xT`` (N, rows), ``b`` (N,) added inside the product (``addmm``) when given: the bias
    added to the float32 sums before the one rounding, as ``F.linear`` adds it (in bf16 equal to
    autocast's biased product to the last bit at 1-200 rows; in fp32 as the bias-free product)."""
    return torch.mm(W, xT) if b is None else torch.addmm(b.unsqueeze(1), W, xT)


def _linear_t_bf16(m: nn.Module, xT: torch.Tensor) -> torch.Tensor:
    """``linear_t`` for a bf16 ``xT`` (K, rows) under CPU bf16 autocast in a ``bf16_weights()``
    region, computed as autocast computes ``m(x)``: ``Wb @ xT`` from W's bf16 copy (``bb + Wb @ xT``
    with a bias, ``_mm_bias``), and for a plain peft LoRA ``Linear`` ``+ (Bb @ (Ab @ xT)) * scaling``
    per adapter, every product's output bf16 and the sum in bf16 (no gradient here, so the factors'
    copies serve too). The weight-major bf16 product equals the ``x @ W.T`` one to the last bit (both
    accumulate in float32 and round once; checked at 1-256 rows on SmolLM2's and small shapes).
    Anything else runs the module."""
    lora = ((m.weight, m.bias, []) if type(m) is nn.Linear and not _hooked(m)
            else _plain_lora(m, torch.float32))
    if lora is not None:
        W, b, adapters = lora
        ws = [_bf16_copy(W)] + [_bf16_copy(t) for A, B, _ in adapters for t in (A, B)]
        bb = None if b is None else _bf16_copy(b)
        if all(w is not None for w in ws) and (b is None or bb is not None):
            out = _mm_bias(ws[0], bb, xT)                                        # (N, rows)
            for i, (_, _, scaling) in enumerate(adapters):
                _add_lora_bf16(out, torch.mm(ws[2 + 2 * i], torch.mm(ws[1 + 2 * i], xT)), scaling)
            return out
    return m(xT.t()).t()


def _stack_plan(mods: tuple[nn.Module, ...]
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor], list] | None:
    """(the stacked bf16 copy of ``mods``' base weights then LoRA A factors, their stacked bf16 biases
    (zeros where a row has none) or None when no module has one, the LoRA B factors' bf16 copies,
    [(base weight, base bias, [(A, B, scaling), ...]) per module]) in the current ``bf16_weights()``
    region, or None (see ``_stacked_t_bf16``). Made at the first call in a region: a no-gradient
    prefill calls it before its own products so that their copies are already the stack's rows."""
    scope = getattr(_SCOPE, "weights", None)
    if scope is None:
        return None
    plans = []
    for m in mods:
        if type(m) is nn.Linear and not _hooked(m):
            plans.append((m.weight, m.bias, []))
        else:
            lora = _plain_lora(m, torch.float32)
            if lora is None:
                return None
            plans.append(lora)
    weights = tuple(W for W, _, _ in plans) + tuple(A for _, _, ad in plans for A, _, _ in ad)
    stack = scope.stacked(weights)
    biases = tuple(b for _, b, _ in plans) + (None,) * (len(weights) - len(plans))
    bias = scope.stacked_bias(biases, tuple(w.size(0) for w in weights)) if any(b is not None for b in biases) else None
    Bs = [scope.get(B) for _, _, ad in plans for _, B, _ in ad]
    if stack is None or any(b is None for b in Bs) or (bias is None and any(b is not None for b in biases)):
        return None
    return stack, bias, Bs, plans


def _stacked_t_bf16(mods: tuple[nn.Module, ...], xT: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """``[_linear_t_bf16(m, xT) for m in mods]`` for modules that read the same bf16 ``xT`` (K, rows)
    (q/k/v; gate/up), from one product with their stacked bf16 copies (``_Bf16Weights.stacked``):
    the base weights' rows first, in order, then every LoRA A factor's. Each output is a row
    block of that product, its LoRA terms ``(Bb @ (A rows)) * scaling`` added in place in bf16: the
    same sums as one product per weight (row blocks of a product are its rows' products; checked
    equal to the last bit at 1-256 rows on SmolLM2's and small shapes) and the same bf16 addition.
    Returns (the product (sum N, rows), the outputs: views of its leading row blocks, adjacent in
    ``mods``' order), or None where a module is not a plain Linear or plain LoRA Linear (``_plain_lora``)
    or a copy would not serve; the caller then runs ``linear_t``. On SmolLM2 at 64 rows q/k/v and the
    two LoRA A factors take 186 us in one product against 270 us in five. Biases (Qwen 2's q/k/v)
    are added inside the product from their stacked copy (``_mm_bias``; 0 on the other rows, exact)."""
    plan = _stack_plan(mods)
    if plan is None:
        return None
    stack, bias, Bs, plans = plan
    prod = _mm_bias(stack, bias, xT)                                             # (sum N, rows)
    outs, row = [], 0
    for W, _, _ in plans:
        outs.append(prod[row:row + W.size(0)])
        row += W.size(0)
    i = 0
    for out, (_, _, ad) in zip(outs, plans):
        for A, _, scaling in ad:
            _add_lora_bf16(out, torch.mm(Bs[i], prod[row:row + A.size(0)]), scaling)
            row, i = row + A.size(0), i + 1
    return prod, outs


def _add_lora_bf16(out: torch.Tensor, lora: torch.Tensor, scaling: float) -> None:
    """``out += lora * scaling`` in place, bf16 as peft's ``result + lora_B(lora_A(x)) * scaling``
    computes it under autocast (the scaled product rounded to bf16, then the bf16 sum); for a
    scaling that is a power of two (LoRA's alpha / r usually is) scaling is exact, so the one call
    ``add_(lora, alpha=scaling)`` gives the same numbers."""
    if math.frexp(scaling)[0] == 0.5:
        out.add_(lora, alpha=scaling)
    else:
        out.add_(lora * scaling)


_WM_BF16_OK: list[bool] = []


def _weight_major_bf16_ok() -> bool:
    """Whether this CPU's bf16 products give the same bits weight-major as autocast's ``x @ W.T``:
    ``Wb @ yT`` and ``bb + Wb @ yT`` for a contiguous (K, rows) ``yT`` (as one weight-major product
    hands the next) against ``F.linear(y, Wb[, bb]).t()`` for the contiguous (rows, K) ``y``, on a probe of SmolLM2's MLP shape
    at 8 and 64 rows; checked once per process. Where oneDNN computes bf16 products (AVX-512 BF16,
    AMX) both layouts round alike; on a CPU without native bf16 (an AMD EPYC with AVX2 only, torch
    2.13) the products depend on the operands' layout (9 of 98,304 outputs of that probe one bf16
    step apart), so the decode steps there keep autocast's row-major products."""
    if not _WM_BF16_OK:
        gen = torch.Generator().manual_seed(0)
        W = torch.randn(1536, 576, generator=gen).to(torch.bfloat16)
        b = torch.randn(1536, generator=gen).to(torch.bfloat16)
        ok = True
        for rows in (8, 64):
            y = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)          # (rows, K) as autocast has it
            yT = y.t().contiguous()                                               # (K, rows) as weight-major has it
            ok = ok and torch.equal(_mm_bias(W, None, yT), F.linear(y, W).t())
            ok = ok and torch.equal(_mm_bias(W, b, yT), F.linear(y, W, b).t())
        _WM_BF16_OK.append(bool(ok))
    return _WM_BF16_OK[0]


def _weight_major(h: torch.Tensor) -> torch.dtype | None:
    """The dtype of the weight-major products (``linear_t``) of a forward on ``h`` (B, L, d), or None
    for the usual products: CPU, float32 ``h``, no gradient, at most ``HEAD_ROWS`` rows (decode
    steps); float32 products without autocast, bf16 ones under CPU bf16 autocast inside a
    ``bf16_weights()`` region (from the weights' bf16 copies: autocast's numbers) where this CPU's
    bf16 products round alike in both layouts (``_weight_major_bf16_ok``)."""
    if (h.device.type != "cpu" or h.dtype != torch.float32 or torch.is_grad_enabled()
            or h.numel() // h.size(-1) > HEAD_ROWS):
        return None
    if not torch.is_autocast_enabled("cpu"):
        return torch.float32
    return (torch.bfloat16 if _cpu_bf16_autocast(h.device) and getattr(_SCOPE, "weights", None)
            and _weight_major_bf16_ok() else None)


def _mlp_t(mlp: nn.Module, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``mlp(x).t()`` for x (rows, d): (d, rows), a stock MLP (``_stock_mlp``) with weight-major products in
    ``dtype`` (``_weight_major``)."""
    if not _stock_mlp(mlp):
        return mlp(x).t()
    xT = x.to(dtype).t()
    mods = _gate_up_mods(mlp)
    stacked = _stacked_t_bf16(mods, xT) if dtype == torch.bfloat16 else None
    parts = stacked[1] if stacked is not None else [linear_t(m, xT) for m in mods]
    g, u = parts if len(parts) == 2 else parts[0].chunk(2, dim=0)
    mT = _act(mlp)(g) * u                                                        # (I, rows)
    return linear_t(mlp.down_proj, mT)


def _prestack(layer: nn.Module) -> None:
    """Make a decoder layer's stacked bf16 copies (q/k/v, gate/up; ``_stack_plan``) in the current
    region: a no-gradient bf16 prefill calls it before its own products, so that their copies are
    already the stacks' rows and the decode steps that follow read the stacks."""
    _stack_plan(_qkv_mods(layer.self_attn))
    if _stock_mlp(layer.mlp):
        _stack_plan(_gate_up_mods(layer.mlp))


def _project_qkv(attn: nn.Module, x: torch.Tensor, wm: torch.dtype | None, rot: tuple[torch.Tensor, torch.Tensor],
                 H: int, Hkv: int, kv_bf16: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated queries (B, L, H, D), rotated keys and values (B, Hkv, L, D) of a layer's normed input
    x (B, L, d). ``wm`` (``_weight_major``): None for the usual products, ``rot`` then the rope
    table's (cos, sin) (B, L, 1, D); else weight-major products in that dtype, ``rot`` (cosT, sinT)
    (D, B*L), rotated in that layout (contiguous heads; the same products): under bf16 q, k, v in
    one product from stacked copies (``_stacked_t_bf16``), q and k rotated together and, with
    ``kv_bf16``, cast to bf16 together."""
    B, L, d = x.shape
    D = attn.head_dim
    if wm is None:
        cos, sin = rot
        mods = _qkv_mods(attn)
        outs = _stacked_linear(mods, x) or [linear(m, x) for m in mods]
        q, k, v = outs if len(outs) == 3 else outs[0].split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k = q.view(B, L, H, D), k.view(B, L, Hkv, D)
        v = v.view(B, L, Hkv, D).transpose(1, 2)                                 # (B, Hkv, L, D)
        if getattr(attn, "q_norm", None) is not None:                            # Qwen 3: per-head norms
            q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
        q = q * cos + q.roll(D // 2, dims=-1) * sin                              # (B, L, H, D)
        k = (k * cos + k.roll(D // 2, dims=-1) * sin).transpose(1, 2)            # (B, Hkv, L, D)
        return q, k, v
    cosT, sinT = rot
    xT = x.view(B * L, d).to(wm).t()                                             # (d, B*L), cast once
    mods = _qkv_mods(attn)
    stacked = _stacked_t_bf16(mods, xT) if wm == torch.bfloat16 else None
    if stacked is not None:
        prod = stacked[0]                                    # rows: q's, k's, v's (then LoRA A factors')
        vT = prod[(H + Hkv) * D:(H + 2 * Hkv) * D]
        qkT = prod[:(H + Hkv) * D].view(H + Hkv, D, B * L)                       # q and k: adjacent rows
        if getattr(attn, "q_norm", None) is not None:
            qkT = torch.cat([_head_norm_t(attn.q_norm, qkT[:H]), _head_norm_t(attn.k_norm, qkT[H:])])
        qkT = qkT * cosT + qkT.roll(D // 2, dims=1) * sinT
        if kv_bf16:
            qkT = qkT.to(torch.bfloat16)
        qT, kT = qkT[:H], qkT[H:]
    else:
        outs = [linear_t(m, xT) for m in mods]
        qT, kT, vT = outs if len(outs) == 3 else outs[0].split([H * D, Hkv * D, Hkv * D], dim=0)
        qT, kT = qT.reshape(H, D, B * L), kT.reshape(Hkv, D, B * L)
        if getattr(attn, "q_norm", None) is not None:
            qT, kT = _head_norm_t(attn.q_norm, qT), _head_norm_t(attn.k_norm, kT)
        qT = qT * cosT + qT.roll(D // 2, dims=1) * sinT
        kT = kT * cosT + kT.roll(D // 2, dims=1) * sinT
    q = qT.permute(2, 0, 1).view(B, L, H, D)
    k = kT.permute(2, 0, 1).view(B, L, Hkv, D).transpose(1, 2)
    v = vT.t().view(B, L, Hkv, D).transpose(1, 2)
    return q, k, v


def _head_norm_t(norm: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """A per-head norm (Qwen 3's ``q_norm`` / ``k_norm``) of t (n, D, rows) in the weight-major
    layout: computed on the heads as contiguous (rows, n, D) rows, as the other path computes it on
    (B, L, n, D) (the same reduction per head, so the same numbers), returned as a (n, D, rows) view."""
    return rms_norm(norm, t.permute(2, 0, 1).contiguous()).permute(1, 2, 0)


def _live_rows(ids: torch.Tensor, full_am: torch.Tensor, cache: LeanCache | None) -> torch.Tensor | None:
    """(n,) the rows of a CPU decode step without gradient still decoding (their new column is real),
    when they are at most ``LIVE_ROWS`` of the rows and at least one; else None (all rows computed)."""
    if cache is None or ids.size(1) != 1 or torch.is_grad_enabled() or ids.device.type != "cpu":
        return None
    live = full_am[:, -1] != 0                                                   # (B,)
    n = int(live.sum())
    return live.nonzero().squeeze(1) if 0 < n <= LIVE_ROWS * ids.size(0) else None


def _all_rows(t: torch.Tensor, live: torch.Tensor, B: int, bufs: dict, key: str) -> torch.Tensor:
    """``t`` (n, ...) of the live rows as (B, ...) with zeros on the other rows, in a buffer kept in
    ``bufs`` under ``key`` across layers (the finished rows stay zero; each layer writes the live ones)."""
    buf = bufs.get(key)
    if buf is None or buf.dtype != t.dtype or buf.shape[1:] != t.shape[1:]:
        buf = bufs[key] = t.new_zeros(B, *t.shape[1:])
    return buf.index_copy_(0, live, t)


def _attention_masks(full_am: torch.Tensor, cache: LeanCache | None, past: int, L: int, Hkv: int, rep: int,
                     dtype: torch.dtype, small: bool, window: int | None = None) -> tuple:
    """(grouped, gmask, gchunks, addmask, sdpa_mask): the masks the layers of a forward with sliding
    ``window`` (None: none) share, one kind set, the others None (grouped False). A cache in the
    grouped layout: its boolean (P, G, L, prefix + G * steps) mask and query chunks
    (``_group_chunks``); else with ``small`` one additive (B*Hkv, rep*L, S) mask in ``dtype`` for the
    explicit products; else SDPA's boolean (B, 1, L, S)."""
    B, S = full_am.size(0), past + L
    if cache is not None and cache.group > 1:
        gmask = _group_attend_mask(full_am, cache.prefix, cache.group, past, L, window)
        return True, gmask, _group_chunks(gmask, Hkv, rep, dtype), None, None
    if small:
        addmask = _additive(_attend_mask(full_am, past, L, window), dtype)        # (B, L|1, S)
        return False, None, None, addmask[:, None, None].expand(B, Hkv, rep, L, S).reshape(B * Hkv, rep * L, S), None
    return False, None, None, None, _attend_mask(full_am, past, L, window)[:, None]  # (B, 1, L|1, S)


def _explicit_attention(cfg, device: torch.device, L: int, S: int) -> bool:
    """Whether L queries over S keys take the explicit products (``SMALL_ATTENTION`` on a CPU, and
    always for a model that soft-caps its scores, which SDPA cannot) rather than SDPA."""
    return (device.type == "cpu" and L * S <= SMALL_ATTENTION) or getattr(cfg, "attn_logit_softcapping", None) is not None


def _layer_masks(hf_model: nn.Module, full_am: torch.Tensor, cache: LeanCache | None, past: int, L: int, Hkv: int,
                 rep: int, dtype: torch.dtype, small: bool) -> tuple[list, dict]:
    """(each layer's window key, {key: ``_attention_masks``}): a window at least as wide as the
    sequence masks nothing, so those layers share the unwindowed masks (key None)."""
    windows = [None if w is None or w >= full_am.size(1) else w for w in layer_windows(hf_model)]
    return windows, {w: _attention_masks(full_am, cache, past, L, Hkv, rep, dtype, small, w) for w in set(windows)}


def _rope_tables(hf_model: nn.Module, rope: RopeTable, positions: torch.Tensor, dtype: torch.dtype,
                 block_size: int | None, transposed: bool) -> tuple[list, dict]:
    """(each layer's rotary table key, ``layer_rope_types``; {key: (cos, sin)}) for ``positions``
    (n, L): each (n, L, 1, D), or ``transposed`` (D, n*L) for the weight-major products."""
    keys = layer_rope_types(hf_model)
    tables = {k: rope(hf_model, positions, dtype, block_size, k) for k in set(keys)}
    if transposed:
        tables = {k: tuple(c.reshape(-1, c.size(-1)).t() for c in t) for k, t in tables.items()}
    return keys, tables


def _qkv_in(layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, H: int, Hkv: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first half of a decoder layer on the usual path (not weight-major): the input norm, then
    the rotated q (B, L, H, D) and k, v (B, Hkv, L, D) (``_project_qkv``)."""
    return _project_qkv(layer.self_attn, rms_norm(layer.input_layernorm, h), None, (cos, sin), H, Hkv, False)


def _sandwich(layer: nn.Module) -> bool:
    """Whether a decoder layer normalizes its attention's and its MLP's outputs before their residual
    adds (Gemma 3: ``post_attention_layernorm`` on the attention's output, ``pre_feedforward_layernorm``
    before the MLP, ``post_feedforward_layernorm`` after it); a Llama layer's ``post_attention_layernorm``
    is its MLP's input norm."""
    return layer._modules.get("pre_feedforward_layernorm") is not None      # a dict lookup: called per layer and step


def _attn_residual(layer: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """What a layer adds to its residual stream from its attention block's output ``a`` (o_proj's)."""
    return rms_norm(layer.post_attention_layernorm, a) if _sandwich(layer) else a


def _mlp_norm(layer: nn.Module) -> nn.Module:
    """A layer's norm before its MLP."""
    return layer.pre_feedforward_layernorm if _sandwich(layer) else layer.post_attention_layernorm


def _mlp_residual(layer: nn.Module, m: torch.Tensor) -> torch.Tensor:
    """What a layer adds to its residual stream from its MLP's output ``m``."""
    return rms_norm(layer.post_feedforward_layernorm, m) if _sandwich(layer) else m


def _out_rest(layer: nn.Module, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """A decoder layer after its attention output o (B, L, H * D), on the usual path: o_proj and its
    residual, the MLP block and its residual -> the layer's output (B, L, d)."""
    h = h + _attn_residual(layer, linear(layer.self_attn.o_proj, o))
    return h + _mlp_residual(layer, _mlp(layer.mlp, rms_norm(_mlp_norm(layer), h)))


def _layer_out(layer: nn.Module, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               att: tuple) -> torch.Tensor:
    """The rest of a decoder layer on the usual path: attention over k, v (the cache's, appended to;
    ``att`` = (grouped, gmask, gchunks, addmask, sdpa_mask) as ``lean_forward`` built them), o_proj
    and the residual, the MLP block and its residual -> the layer's output (B, L, d)."""
    attn = layer.self_attn
    grouped, gmask, gchunks, addmask, sdpa_mask = att
    cap = getattr(attn, "attn_logit_softcapping", None)
    o = (_grouped_attention(q, k, v, gmask, gchunks, attn.scaling, cap) if grouped
         else _attention(q.transpose(1, 2), k, v, attn.scaling, addmask, sdpa_mask, cap))
    return _out_rest(layer, h, o)


def lean_forward(hf_model: nn.Module, ids: torch.Tensor, full_am: torch.Tensor, positions: torch.Tensor,
                 cache: LeanCache | None, logits_to_keep: int | None, rope: RopeTable,
                 block_size: int | None, checkpoint: bool = False, compiled: bool = False) -> torch.Tensor:
    """Logits (B, L or logits_to_keep, V) in the weights' dtype of a stock ``LlamaForCausalLM`` (or a
    ``lean_families`` model).

    ``ids`` (B, L); ``full_am`` (B, S) the attention mask of the cached columns and these;
    ``positions`` (B, L). With ``cache`` the new keys / values are appended to it (the caller
    updates its mask and positions). RoPE from ``rope``, GQA by grouping the query heads of a kv
    head (or a head repeat for SDPA), explicit matmul attention for small CPU shapes else SDPA with
    a boolean mask (a cache in the grouped layout: ``_grouped_attention``), weight-major
    projections where ``_weight_major`` says so, a decode step's layers and head on its live rows
    only where ``_live_rows`` says so, and ``logits_to_keep`` applied before the final norm and head.
    Layers with a sliding window (``layer_windows``) attend through masks with the window applied
    (built once per distinct window narrower than the sequence).

    ``checkpoint`` (a training forward with gradient: model.gradient_checkpointing): each layer runs
    as two checkpointed halves (``_qkv_in``, ``_layer_out``; torch.utils.checkpoint, non-reentrant)
    with the cache append between them, so the backward keeps each layer's input and its q, k, v and
    recomputes the rest; the append is not repeated by the recompute. The same numbers.

    ``compiled`` (model.compile): in a call of more than one token per row (a prefill, a training or
    scoring forward; not a decode step) each layer that ``compiled_plan`` covers runs through
    compiled functions (``_compiled_qkv``, the attention unless the cache has the grouped layout,
    ``_compiled_out``; not with ``checkpoint``).
    """
    inner = hf_model.model
    B, L = ids.shape
    past = 0 if cache is None else cache.length
    S = past + L
    live = _live_rows(ids, full_am, cache)                                       # (n,) or None: all rows
    rows_bufs: dict = {}
    if live is not None:
        ids, positions = ids[live], positions[live]                              # (n, 1)
    h = inner.embed_tokens(ids)                                                  # (n, L, d); n = B or live

    cfg = hf_model.config
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    rep = H // Hkv
    # Under CPU bf16 autocast the attention products cast their operands to bf16 (autocast's list):
    # the additive masks are built in bf16 once (0 and -inf are exact), and without gradient the
    # queries and the cached keys are cast once when made instead of at every layer's product (the
    # same values: a cast is elementwise), so a decode step does not re-cast the whole key cache.
    att_bf16 = _cpu_bf16_autocast(ids.device)
    kv_bf16 = att_bf16 and cache is not None and not torch.is_grad_enabled()
    windows, atts = _layer_masks(hf_model, full_am, cache, past, L, Hkv, rep, torch.bfloat16 if att_bf16 else h.dtype,
                                 small=_explicit_attention(cfg, ids.device, L, S))

    wm = _weight_major(h)                               # the products' dtype, or None: not weight-major
    # a no-gradient bf16 forward that is not weight-major (a prefill) makes the stacks decode reads
    prestack = (wm is None and att_bf16 and not torch.is_grad_enabled()
                and getattr(_SCOPE, "weights", None) is not None and _weight_major_bf16_ok())
    n, d = h.shape[0], h.size(-1)                                               # n: the rows computed
    rope_keys, tables = _rope_tables(hf_model, rope, positions, h.dtype, block_size, wm is not None)
    checkpoint = checkpoint and torch.is_grad_enabled() and wm is None and live is None
    compiled = compiled and not checkpoint and L > 1 and compile_available()   # decode steps stay eager
    for li, layer in enumerate(inner.layers):
        attn = layer.self_attn
        D = attn.head_dim
        cos, sin = tables[rope_keys[li]]                # (n, L, 1, D); weight-major: (D, n*L)
        att, cap = atts[windows[li]], getattr(attn, "attn_logit_softcapping", None)
        if checkpoint:
            q, k, v = torch.utils.checkpoint.checkpoint(_qkv_in, layer, h, cos, sin, H, Hkv, use_reentrant=False)
            if cache is not None:
                k, v = cache.append(li, k, v)
            h = torch.utils.checkpoint.checkpoint(_layer_out, layer, h, q, k, v, att, use_reentrant=False)
            continue
        if prestack:
            _prestack(layer)
        plan = compiled_plan(layer) if compiled and wm is None and live is None else None
        if plan is not None:                  # the per-token parts compiled (model.compile), attention as below
            q, k, v = _compiled_qkv(layer, h, plan, cos, sin, H, Hkv)
        else:
            q, k, v = _project_qkv(attn, rms_norm(layer.input_layernorm, h), wm, (cos, sin), H, Hkv, kv_bf16)
        if kv_bf16:
            q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
        if live is not None:                                                     # every row, zeros if finished
            q, k, v = (_all_rows(t, live, B, rows_bufs, key) for t, key in ((q, "q"), (k, "k"), (v, "v")))
        if cache is not None:
            k, v = cache.append(li, k, v)                                        # grouped: keys (P, Hkv, D, S)
        if att[0]:                                                               # the grouped layout
            o = _grouped_attention(q, k, v, att[1], att[2], attn.scaling, cap)   # (B, L, H*D)
        elif plan is not None:                                                   # compiled (model.compile)
            args = (q.transpose(1, 2), k, v, attn.scaling, att[3], att[4], cap)
            o = compiled_call("attn rows", _attention, args, ((0, 2), (1, 2), (2, 2)), lambda: _attention(*args))
        else:
            o = _attention(q.transpose(1, 2), k, v, attn.scaling, att[3], att[4], cap)  # (B, L, H*D)
        if live is not None:
            o = o.index_select(0, live)                                          # (n, L, H*D)
        if plan is not None:
            h = _compiled_out(layer, h, o, plan)
        elif wm is not None:
            h = h + _attn_residual(layer, linear_t(attn.o_proj, o.view(n * L, H * D).to(wm).t()).t().view(n, L, d))
            x = rms_norm(_mlp_norm(layer), h).view(n * L, d)
            h = h + _mlp_residual(layer, _mlp_t(layer.mlp, x, wm).t().view(n, L, d))
        else:
            h = _out_rest(layer, h, o)
    k_keep = int(logits_to_keep) if logits_to_keep is not None else 0
    if 0 < k_keep < L:
        h = h[:, -k_keep:]
    logits = _softcap(output_head(hf_model.lm_head, rms_norm(inner.norm, h)),    # (n, L', V)
                      getattr(cfg, "final_logit_softcapping", None))
    return logits if live is None else _all_rows(logits, live, B, rows_bufs, "logits")



# ---------------------------------------------------------------------- compiled layer parts
def _proj(m: nn.Module) -> tuple | None:
    """(weight, bias or None, ((A, B, scaling), ...)) of a plain ``nn.Linear`` or plain peft LoRA
    ``Linear`` (``_plain_lora``) for ``_lin``, weight and bias as ``linear`` reads them (the region's
    bf16 copies of weights that need no gradient here under CPU bf16 autocast); None for anything else."""
    if type(m) is nn.Linear and not _hooked(m):
        W, b, adapters = m.weight, m.bias, []
    else:
        plan = _plain_lora(m, torch.float32)
        if plan is None:
            return None
        W, b, adapters = plan
    if _cpu_bf16_autocast(W.device):
        Wb, bb = _bf16_copy(W), None if b is None else _bf16_copy(b)
        W, b = (W if Wb is None else Wb), (b if bb is None else bb)
    return W, b, tuple(adapters)


def _is_silu(act: nn.Module) -> bool:
    """Whether an MLP's activation module computes ``F.silu`` (torch's ``nn.SiLU``, transformers'
    ``SiLUActivation``), with no hooks."""
    if _hooked(act):
        return False
    if type(act) is nn.SiLU:
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # pragma: no cover - older transformers map "silu" to nn.SiLU
        return False
    return type(act) is SiLUActivation


def compiled_plan(layer: nn.Module) -> tuple | None:
    """What ``_compiled_qkv`` / ``_compiled_out`` read of a Llama-type decoder layer (Llama, Mistral,
    Qwen 2, SmolLM: RMSNorms with ``variance_epsilon``, q/k/v with optional biases, no per-head norms,
    no norms around the attention or MLP outputs, a SiLU-gated MLP; every projection a plain Linear or
    plain LoRA Linear): (input norm weight, eps, (q, k, v) ``_proj``s, o_proj's, MLP norm weight,
    eps, gate, up, down ``_proj``s); None for any other layer, which runs eagerly."""
    attn, mlp = layer.self_attn, layer.mlp
    n1, n2 = layer.input_layernorm, layer._modules.get("post_attention_layernorm")
    if (_sandwich(layer) or getattr(attn, "q_norm", None) is not None or "qkv_proj" in attn._modules
            or not _stock_mlp(mlp) or "gate_up_proj" in mlp._modules or not _is_silu(_act(mlp))
            or getattr(attn, "attn_logit_softcapping", None) is not None or n2 is None):
        return None
    norms = []
    for n in (n1, n2):
        eps = getattr(n, "variance_epsilon", None)
        if eps is None or _hooked(n) or n.weight.dtype != torch.float32:
            return None
        norms.append((n.weight, float(eps)))
    projs = [_proj(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                                mlp.down_proj)]
    if any(p is None for p in projs):
        return None
    return norms[0][0], norms[0][1], tuple(projs[:3]), projs[3], norms[1][0], norms[1][1], projs[4], projs[5], projs[6]


def _lin(x: torch.Tensor, p: tuple) -> torch.Tensor:
    """``linear``'s product for ``_proj``'s p: ``x @ W.T + b``, then ``+ lora_B(lora_A(x)) * scaling``
    per adapter, peft's order (casts to bf16 by autocast where it is on)."""
    W, b, adapters = p
    y = F.linear(x, W, b)
    for A, B, scaling in adapters:
        y = y + F.linear(F.linear(x, A), B) * scaling
    return y


def _qkv_block(h: torch.Tensor, nw: torch.Tensor, eps: float, projs: tuple, cos: torch.Tensor, sin: torch.Tensor,
               H: int, Hkv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's first half as ``_qkv_in`` computes it: h (B, L, d) -> rotated q (B, L, H, D), k and
    v (B, Hkv, L, D); cos / sin (B, L, 1, D)."""
    x = F.rms_norm(h, (h.size(-1),), nw, eps)
    q, k, v = (_lin(x, p) for p in projs)
    B, L = h.shape[:2]
    D = cos.size(-1)
    q, k = q.view(B, L, H, D), k.view(B, L, Hkv, D)
    v = v.view(B, L, Hkv, D).transpose(1, 2)
    q = q * cos + q.roll(D // 2, dims=-1) * sin
    k = (k * cos + k.roll(D // 2, dims=-1) * sin).transpose(1, 2)
    return q, k, v


def _out_block(h: torch.Tensor, o: torch.Tensor, po: tuple, nw: torch.Tensor, eps: float, pg: tuple, pu: tuple,
               pd: tuple) -> torch.Tensor:
    """A layer's second half after its attention output o (B, L, H * D): o_proj and the residual, the
    MLP's norm, ``down(silu(gate(x)) * up(x))`` and the residual -> (B, L, d)."""
    h = h + _lin(o, po)
    x = F.rms_norm(h, (h.size(-1),), nw, eps)
    return h + _lin(F.silu(_lin(x, pg)) * _lin(x, pu), pd)


def _shared_layer_block(h: torch.Tensor, plan: tuple, cos: torch.Tensor, sin: torch.Tensor, H: int, Hkv: int,
                        P: int, Lp: int, G: int, scaling: float, cap: float | None, att_p: tuple,
                        att_r: tuple) -> torch.Tensor:
    """A whole decoder layer of ``lean_forward_shared``'s one pass as one function to compile:
    ``_qkv_block``, ``_attend_parts``, ``_out_block`` (``compiled_plan``'s ``plan``)."""
    q, k, v = _qkv_block(h, plan[0], plan[1], plan[2], cos, sin, H, Hkv)
    o = _attend_parts(q, k, v, P, Lp, G, scaling, cap, att_p, att_r)
    return _out_block(h, o, *plan[3:])


def _compiled_qkv(layer: nn.Module, h: torch.Tensor, plan: tuple, cos: torch.Tensor, sin: torch.Tensor,
                  H: int, Hkv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_qkv_in`` through the compiled ``_qkv_block`` (``compiled_plan``'s ``plan``)."""
    return compiled_call("qkv", _qkv_block, (h, plan[0], plan[1], plan[2], cos, sin, H, Hkv), ((0, 1), (4, 1), (5, 1)),
                          lambda: _qkv_in(layer, h, cos, sin, H, Hkv))


def _compiled_out(layer: nn.Module, h: torch.Tensor, o: torch.Tensor, plan: tuple) -> torch.Tensor:
    """``_out_rest`` through the compiled ``_out_block``."""
    return compiled_call("out", _out_block, (h, o) + plan[3:], ((0, 1), (1, 1)), lambda: _out_rest(layer, h, o))


def _shared_attention(layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      P: int, Lp: int, G: int, att_p: tuple, att_r: tuple) -> torch.Tensor:
    """Attention in ``lean_forward_shared``'s one pass: ``_attend_parts`` with the layer's scaling and
    soft cap."""
    attn = layer.self_attn
    return _attend_parts(q, k, v, P, Lp, G, attn.scaling, getattr(attn, "attn_logit_softcapping", None), att_p, att_r)


def _attend_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, P: int, Lp: int, G: int, scaling: float,
                  cap: float | None, att_p: tuple, att_r: tuple) -> torch.Tensor:
    """q (1, N, H, D), k / v (1, Hkv, N, D) of the P * Lp prompt tokens, then the B * L response tokens
    (B = P * G), attended per part: the prompts over their own keys with masks ``att_p``, each
    response over its prompt's keys, repeated G times as a cache with gradient holds them, and its
    own with ``att_r`` (both as ``_attention_masks`` builds them) -> o (1, N, H * D)."""
    _, N, H, D = q.shape
    Hkv, Np, B = k.size(1), P * Lp, P * G
    L = (N - Np) // B
    # split, not sliced: the backward joins the parts' gradients in one copy (a slice's would fill
    # a zero tensor of all N tokens for each part and add them)
    qp, qr = q[0].split([Np, B * L])                                       # (Np, H, D), (B*L, H, D)
    (kp, kr), (vp, vr) = (t[0].split([Np, B * L], dim=1) for t in (k, v))  # (Hkv, Np | B*L, D)
    kp, vp = (t.view(Hkv, P, Lp, D).transpose(0, 1) for t in (kp, vp))        # (P, Hkv, Lp, D)
    kr, vr = (t.view(Hkv, B, L, D).transpose(0, 1) for t in (kr, vr))        # (B, Hkv, L, D)
    kr = torch.cat([kp.repeat_interleave(G, dim=0), kr], dim=2)                    # (B, Hkv, Lp + L, D)
    vr = torch.cat([vp.repeat_interleave(G, dim=0), vr], dim=2)
    op = _attention(qp.view(P, Lp, H, D).transpose(1, 2), kp, vp, scaling, att_p[3], att_p[4], cap)
    orr = _attention(qr.view(B, L, H, D).transpose(1, 2), kr, vr, scaling, att_r[3], att_r[4], cap)
    return torch.cat([op.view(Np, H * D), orr.view(B * L, H * D)]).unsqueeze(0)   # (1, N, H*D)


def _shared_out(layer: nn.Module, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                P: int, Lp: int, G: int, att_p: tuple, att_r: tuple) -> torch.Tensor:
    """The rest of a decoder layer in ``lean_forward_shared``'s one pass: attention per part
    (``_shared_attention``), then o_proj, its residual, the MLP block and its residual on all N
    tokens -> (1, N, d)."""
    return _out_rest(layer, h, _shared_attention(layer, q, k, v, P, Lp, G, att_p, att_r))


def lean_forward_shared(hf_model: nn.Module, prompt_ids: torch.Tensor, prompt_am: torch.Tensor,
                        prompt_pos: torch.Tensor, resp_ids: torch.Tensor, resp_am: torch.Tensor,
                        resp_pos: torch.Tensor, rope: RopeTable, block_size: int | None,
                        checkpoint: bool = False, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's shared prompt and its G responses in ONE pass over the layers: the logits of each
    prompt's last position (P, 1, V) and of the responses' tokens (B, L, V), B = P * G, in the
    weights' dtype; what ``lean_forward`` gives for the prompts (``logits_to_keep=1``, into a cache)
    and then for the responses over that cache repeated G times, to float rounding.

    ``prompt_ids`` / ``prompt_am`` / ``prompt_pos`` (P, Lp) the prompts (left-padded), their mask
    and positions; ``resp_ids`` / ``resp_am`` / ``resp_pos`` (B, L) the tokens after them, row b
    continuing prompt b // G (positions as ``HFPolicy.forward`` computes them for the two calls). The per-token parts of
    a layer (norms, q/k/v, rotary, o_proj, MLP) run once on the P * Lp + B * L tokens as one
    (1, N, d) block instead of in two calls of P * Lp and B * L rows: half the calls, and products
    of more rows, which the CPU's bf16 kernels run faster than either part (SmolLM2's layer
    products, 376 and 960 rows apart against 1,336 together, forward and input gradient on a 2-core
    Xeon with AMX: 372 against 246 ms). Attention runs per part: the prompts causally over their
    own keys, each response over its prompt's keys (repeated G times, as a cache with gradient
    holds them) and its own, masked as the two calls mask them. ``checkpoint`` (a training forward with gradient: model.gradient_checkpointing): each
    layer as ``lean_forward``'s two checkpointed halves (``_qkv_in``, ``_shared_out``), the same
    numbers. ``compiled`` (model.compile): each layer that ``compiled_plan`` covers runs as one
    compiled function (``_shared_layer_block``; not with ``checkpoint``)."""
    inner, cfg = hf_model.model, hf_model.config
    P, Lp = prompt_ids.shape
    B, L = resp_ids.shape
    G, Np = B // P, P * Lp
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    rep = H // Hkv
    positions = torch.cat([prompt_pos.reshape(1, Np), resp_pos.reshape(1, B * L)], dim=1)  # (1, N)
    h = inner.embed_tokens(torch.cat([prompt_ids.reshape(1, Np), resp_ids.reshape(1, B * L)], dim=1))  # (1, N, d)
    d = h.size(-1)
    full_am = torch.cat([prompt_am.repeat_interleave(G, dim=0), resp_am], dim=1)    # (B, Lp + L)
    att_dtype = torch.bfloat16 if _cpu_bf16_autocast(h.device) else h.dtype
    win_p, atts_p = _layer_masks(hf_model, prompt_am, None, 0, Lp, Hkv, rep, att_dtype,
                                 _explicit_attention(cfg, h.device, Lp, Lp))
    win_r, atts_r = _layer_masks(hf_model, full_am, None, Lp, L, Hkv, rep, att_dtype,
                                 _explicit_attention(cfg, h.device, L, Lp + L))
    rope_keys, tables = _rope_tables(hf_model, rope, positions, h.dtype, block_size, False)
    checkpoint = checkpoint and torch.is_grad_enabled()
    compiled = compiled and not checkpoint and compile_available()
    for li, layer in enumerate(inner.layers):
        cos, sin = tables[rope_keys[li]]                                    # (1, N, 1, D)
        att_p, att_r = atts_p[win_p[li]], atts_r[win_r[li]]
        if checkpoint:      # as lean_forward's halves: the backward keeps h and q, k, v, recomputes the rest
            q, k, v = torch.utils.checkpoint.checkpoint(_qkv_in, layer, h, cos, sin, H, Hkv, use_reentrant=False)
            h = torch.utils.checkpoint.checkpoint(_shared_out, layer, h, q, k, v, P, Lp, G, att_p, att_r,
                                                  use_reentrant=False)
            continue
        plan = compiled_plan(layer) if compiled else None
        if plan is not None:                  # the whole layer compiled (model.compile)
            attn = layer.self_attn
            args = (h, plan, cos, sin, H, Hkv, P, Lp, G, attn.scaling, getattr(attn, "attn_logit_softcapping", None),
                    att_p, att_r)
            h = compiled_call("layer", _shared_layer_block, args, ((0, 1), (2, 1), (3, 1)),
                              lambda: _shared_out(layer, h, *_qkv_in(layer, h, cos, sin, H, Hkv), P, Lp, G, att_p, att_r))
            continue
        q, k, v = _project_qkv(layer.self_attn, rms_norm(layer.input_layernorm, h), None, (cos, sin), H, Hkv, False)
        h = _shared_out(layer, h, q, k, v, P, Lp, G, att_p, att_r)
    hp, hr = h[0].split([Np, B * L])                                                     # (Np, d), (B*L, d)
    last = hp.view(P, Lp, d)[:, -1:]                                                     # (P, 1, d) each prompt's last
    soft = getattr(cfg, "final_logit_softcapping", None)
    first = _softcap(output_head(hf_model.lm_head, rms_norm(inner.norm, last)), soft)     # (P, 1, V)
    resp = _softcap(output_head(hf_model.lm_head, rms_norm(inner.norm, hr.view(B, L, d))), soft)  # (B, L, V)
    return first, resp
