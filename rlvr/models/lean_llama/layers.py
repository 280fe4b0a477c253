"""The pieces of a decoder layer on the lean path: norms, the q/k/v projections and the rotation,
the output projection and the MLP with their residuals, and the output head. Each product goes
through ``linear`` (row-major) or ``linear_t`` (weight-major, decode steps); how those compute on
the CPU is their modules' business (rlvr.models.lean_llama.products, .weight_major)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import _attend_parts, _attention, _grouped_attention
from .limits import HEAD_CHUNK, HEAD_ROWS
from .modules import _act, _gate_up_mods, _hooked, _qkv_mods, _sandwich, _stock_mlp
from .products import _packed_head, _stacked_linear, linear
from .weight_major import _mlp_t, _stack_plan, _stacked_t_bf16, linear_t


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
    weight-major on CPU). Under CPU bf16 autocast it is one bf16 product (``linear``; from the
    head's pack, ``_packed_head``): blocks gain nothing there once the logits are converted to
    float32 (see docs/performance.md)."""
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


def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``mlp(x)``: a stock MLP's products through ``linear``."""
    if not _stock_mlp(mlp) or _hooked(mlp):
        return mlp(x)
    mods = _gate_up_mods(mlp)
    parts = _stacked_linear(mods, x) or [linear(m, x) for m in mods]
    g, u = parts if len(parts) == 2 else parts[0].chunk(2, dim=-1)
    return linear(mlp.down_proj, _act(mlp)(g) * u)


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


def _qkv_in(layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, H: int, Hkv: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first half of a decoder layer on the usual path (not weight-major): the input norm, then
    the rotated q (B, L, H, D) and k, v (B, Hkv, L, D) (``_project_qkv``)."""
    return _project_qkv(layer.self_attn, rms_norm(layer.input_layernorm, h), None, (cos, sin), H, Hkv, False)


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


def _out_rest_t(layer: nn.Module, h: torch.Tensor, o: torch.Tensor, wm: torch.dtype) -> torch.Tensor:
    """``_out_rest`` with weight-major products in ``wm`` (``_weight_major``): o_proj and the MLP of
    h (n, L, d) and the attention output o (n, L, H * D) computed as (features, rows) blocks."""
    n, L, d = h.shape
    h = h + _attn_residual(layer, linear_t(layer.self_attn.o_proj, o.view(n * L, o.size(-1)).to(wm).t()).t().view(n, L, d))
    x = rms_norm(_mlp_norm(layer), h).view(n * L, d)
    return h + _mlp_residual(layer, _mlp_t(layer.mlp, x, wm).t().view(n, L, d))


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


def _shared_attention(layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      P: int, Lp: int, G: int, att_p: tuple, att_r: tuple) -> torch.Tensor:
    """Attention in ``lean_forward_shared``'s one pass: ``_attend_parts`` with the layer's scaling and
    soft cap."""
    attn = layer.self_attn
    return _attend_parts(q, k, v, P, Lp, G, attn.scaling, getattr(attn, "attn_logit_softcapping", None), att_p, att_r)


def _shared_out(layer: nn.Module, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                P: int, Lp: int, G: int, att_p: tuple, att_r: tuple) -> torch.Tensor:
    """The rest of a decoder layer in ``lean_forward_shared``'s one pass: attention per part
    (``_shared_attention``), then o_proj, its residual, the MLP block and its residual on all N
    tokens -> (1, N, d)."""
    return _out_rest(layer, h, _shared_attention(layer, q, k, v, P, Lp, G, att_p, att_r))
