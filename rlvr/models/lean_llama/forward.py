"""The lean Llama forward: a stock ``LlamaForCausalLM``'s own weights (or a ``lean_families``
model's) with transformers' glue (mask building, DynamicCache, rotary module, output capture)
replaced by a few tensor ops, a ``RopeTable`` and a ``LeanCache``: ``lean_forward`` for a call of
any length (prefill, decode step, training or scoring forward), ``lean_forward_shared`` for a
group's shared prompt and its responses in one pass.

The layers' pieces are in rlvr.models.lean_llama.layers and .attention; how their products run on
the CPU (bf16 copies, oneDNN packs, weight-major decode steps) is not this module's concern.

Shapes: B rows, L tokens in this call, S keys attended (cache length + L), H query heads, Hkv
key/value heads, D head dim, rep = H // Hkv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.utils.checkpoint

from rlvr.compiled import compile_available

from .attention import _attention, _explicit_attention, _grouped_attention, _layer_masks, _softcap
from .bf16_copies import _SCOPE, _cpu_bf16_autocast
from .cache import LeanCache
from .compiled_layers import _compiled_out, _compiled_qkv, _compiled_shared_layer, compiled_plan
from .layers import (_layer_out, _out_rest, _out_rest_t, _prestack, _project_qkv, _qkv_in, _shared_out, output_head,
                     rms_norm)
from .limits import LIVE_ROWS
from .rope import RopeTable, _rope_tables
from .weight_major import _weight_major, _weight_major_bf16_ok


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


@dataclass
class _Pass:
    """What every layer of one ``lean_forward`` call shares."""

    H: int
    Hkv: int
    B: int
    """The call's rows (the live ones are a subset, ``live``)."""
    wm: torch.dtype | None
    """The weight-major products' dtype (``_weight_major``), or None: the usual products."""
    kv_bf16: bool
    """Cast q and k to bf16 once when made (no-gradient CPU bf16 autocast with a cache)."""
    prestack: bool
    """Make the stacked bf16 copies decode reads (``_prestack``) before a layer's own products."""
    compiled: bool
    live: torch.Tensor | None
    """(n,) the rows computed (``_live_rows``), or None: all."""
    bufs: dict
    """``_all_rows``' buffers."""


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
    compiled functions (``_compiled_qkv``, ``_compiled_out``; not with ``checkpoint``). The attention
    between them stays eager: it is one SDPA kernel or three products, which compiling does not speed
    up measurably, and its variants (with and without gradient, either mask kind, one row or many, keys
    with or without gradient) would otherwise pass torch._dynamo's limit of 8 compiles of one function
    within a training step.
    """
    inner, cfg = hf_model.model, hf_model.config
    B, L = ids.shape
    past = 0 if cache is None else cache.length
    live = _live_rows(ids, full_am, cache)                                       # (n,) or None: all rows
    if live is not None:
        ids, positions = ids[live], positions[live]                              # (n, 1)
    h = inner.embed_tokens(ids)                                                  # (n, L, d); n = B or live
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    # Under CPU bf16 autocast the attention products cast their operands to bf16 (autocast's list):
    # the additive masks are built in bf16 once (0 and -inf are exact), and without gradient the
    # queries and the cached keys are cast once when made instead of at every layer's product (the
    # same values: a cast is elementwise), so a decode step does not re-cast the whole key cache.
    att_bf16 = _cpu_bf16_autocast(ids.device)
    width = past + L if cache is None else cache.attend_width(past + L)          # columns attended
    windows, atts = _layer_masks(hf_model, full_am, cache, past, L, Hkv, H // Hkv,
                                 torch.bfloat16 if att_bf16 else h.dtype,
                                 small=_explicit_attention(cfg, ids.device, L, width), width=width)
    wm = _weight_major(h)                               # the products' dtype, or None: not weight-major
    checkpoint = checkpoint and torch.is_grad_enabled() and wm is None and live is None
    p = _Pass(H, Hkv, B, wm, kv_bf16=att_bf16 and cache is not None and not torch.is_grad_enabled(),
              # a no-gradient bf16 forward that is not weight-major (a prefill) makes the stacks decode reads
              prestack=(wm is None and att_bf16 and not torch.is_grad_enabled()
                        and getattr(_SCOPE, "weights", None) is not None and _weight_major_bf16_ok()),
              compiled=compiled and not checkpoint and L > 1 and compile_available(),  # decode steps stay eager
              live=live, bufs={})
    rope_keys, tables = _rope_tables(hf_model, rope, positions, h.dtype, block_size, wm is not None)
    for li, layer in enumerate(inner.layers):
        cos, sin = tables[rope_keys[li]]                # (n, L, 1, D); weight-major: (D, n*L)
        if checkpoint:
            h = _checkpointed_layer(layer, li, h, cos, sin, atts[windows[li]], cache, H, Hkv)
        else:
            h = _layer(layer, li, h, cos, sin, atts[windows[li]], cache, p)
    return _logits(hf_model, h, logits_to_keep, p)


def _checkpointed_layer(layer: nn.Module, li: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        att: tuple, cache: LeanCache | None, H: int, Hkv: int) -> torch.Tensor:
    """A decoder layer as two checkpointed halves (``_qkv_in``, ``_layer_out``) with the cache append
    between them, so the recompute does not repeat the append."""
    q, k, v = torch.utils.checkpoint.checkpoint(_qkv_in, layer, h, cos, sin, H, Hkv, use_reentrant=False)
    if cache is not None:
        k, v = cache.append(li, k, v)
    return torch.utils.checkpoint.checkpoint(_layer_out, layer, h, q, k, v, att, use_reentrant=False)


def _layer(layer: nn.Module, li: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, att: tuple,
           cache: LeanCache | None, p: _Pass) -> torch.Tensor:
    """A decoder layer of ``lean_forward``: q, k, v (compiled, weight-major or the usual products), the
    cache append, attention (``att`` = (grouped, gmask, gchunks, addmask, sdpa_mask): grouped
    or plain), then o_proj, the MLP and their residuals -> the layer's output."""
    attn = layer.self_attn
    cap = getattr(attn, "attn_logit_softcapping", None)
    if p.prestack:
        _prestack(layer)
    plan = compiled_plan(layer) if p.compiled and p.wm is None and p.live is None else None
    if plan is not None:                  # the per-token parts compiled (model.compile), attention as below
        q, k, v = _compiled_qkv(layer, h, plan, cos, sin, p.H, p.Hkv)
    else:
        q, k, v = _project_qkv(attn, rms_norm(layer.input_layernorm, h), p.wm, (cos, sin), p.H, p.Hkv, p.kv_bf16)
    if p.kv_bf16:
        q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    if p.live is not None:                                                       # every row, zeros if finished
        q, k, v = (_all_rows(t, p.live, p.B, p.bufs, key) for t, key in ((q, "q"), (k, "k"), (v, "v")))
    if cache is not None:
        k, v = cache.append(li, k, v)                                            # grouped: keys (P, Hkv, D, S)
    if att[0]:                                                                   # the grouped layout
        o = _grouped_attention(q, k, v, att[1], att[2], attn.scaling, cap)       # (B, L, H*D)
    else:
        o = _attention(q.transpose(1, 2), k, v, attn.scaling, att[3], att[4], cap)  # (B, L, H*D)
    if p.live is not None:
        o = o.index_select(0, p.live)                                            # (n, L, H*D)
    if plan is not None:
        return _compiled_out(layer, h, o, plan)
    if p.wm is not None:
        return _out_rest_t(layer, h, o, p.wm)
    return _out_rest(layer, h, o)


def _logits(hf_model: nn.Module, h: torch.Tensor, logits_to_keep: int | None, p: _Pass) -> torch.Tensor:
    """The final norm and the head over the last ``logits_to_keep`` positions of h (n, L, d) (all for
    None or 0), soft-capped where the model caps its logits; (B, L', V) with zero rows for the
    finished ones of a live-rows step."""
    k_keep = int(logits_to_keep) if logits_to_keep is not None else 0
    if 0 < k_keep < h.size(1):
        h = h[:, -k_keep:]
    logits = _softcap(output_head(hf_model.lm_head, rms_norm(hf_model.model.norm, h)),    # (n, L', V)
                      getattr(hf_model.config, "final_logit_softcapping", None))
    return logits if p.live is None else _all_rows(logits, p.live, p.B, p.bufs, "logits")


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
    of more rows, which the CPU's bf16 kernels run faster than either part (see
    docs/performance.md). Attention runs per part: the prompts causally over their
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
            h = _compiled_shared_layer(layer, h, plan, cos, sin, H, Hkv, P, Lp, G, att_p, att_r)
            continue
        q, k, v = _project_qkv(layer.self_attn, rms_norm(layer.input_layernorm, h), None, (cos, sin), H, Hkv, False)
        h = _shared_out(layer, h, q, k, v, P, Lp, G, att_p, att_r)
    hp, hr = h[0].split([Np, B * L])                                                     # (Np, d), (B*L, d)
    last = hp.view(P, Lp, d)[:, -1:]                                                     # (P, 1, d) each prompt's last
    soft = getattr(cfg, "final_logit_softcapping", None)
    first = _softcap(output_head(hf_model.lm_head, rms_norm(inner.norm, last)), soft)     # (P, 1, V)
    resp = _softcap(output_head(hf_model.lm_head, rms_norm(inner.norm, hr.view(B, L, d))), soft)  # (B, L, V)
    return first, resp
