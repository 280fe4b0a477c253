"""Attention of the lean forward: the masks (causal, left padding, sliding windows, the grouped
cache layout), explicit matmul attention for small CPU shapes and SDPA for the rest, grouped
attention over a ``LeanCache`` in the grouped layout, and the shared-prompt pass's per-part
attention.

Shapes: B rows, L tokens in this call, S keys attended (cache length + L), H query heads, Hkv
key/value heads, D head dim, rep = H // Hkv.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .cache import LeanCache
from .families import layer_windows
from .limits import GROUP_SCORES, SMALL_ATTENTION


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


def _attention_masks(full_am: torch.Tensor, cache: LeanCache | None, past: int, L: int, Hkv: int, rep: int,
                     dtype: torch.dtype, small: bool, window: int | None = None, width: int = 0) -> tuple:
    """(grouped, gmask, gchunks, addmask, sdpa_mask): the masks the layers of a forward with sliding
    ``window`` (None: none) share, one kind set, the others None (grouped False). A cache in the
    grouped layout: its boolean (P, G, L, prefix + G * steps) mask and query chunks
    (``_group_chunks``); else with ``small`` one additive (B*Hkv, rep*L, S) mask in ``dtype`` for the
    explicit products; else SDPA's boolean (B, 1, L, S)."""
    B, S = full_am.size(0), past + L
    if cache is not None and cache.group > 1:
        gmask = _group_attend_mask(full_am, cache.prefix, cache.group, past, L, window)
        return True, gmask, _group_chunks(gmask, Hkv, rep, dtype), None, None
    mask = _attend_mask(full_am, past, L, window)                                 # (B, L|1, S)
    if width > S:       # the cache's columns past S (LeanCache.attend_width): masked
        mask = torch.cat([mask, mask.new_zeros(*mask.shape[:2], width - S)], dim=2)
        S = width
    if small:
        addmask = _additive(mask, dtype)
        return False, None, None, addmask[:, None, None].expand(B, Hkv, rep, L, S).reshape(B * Hkv, rep * L, S), None
    return False, None, None, None, mask[:, None]                                # (B, 1, L|1, S)


def _explicit_attention(cfg, device: torch.device, L: int, S: int) -> bool:
    """Whether L queries over S keys take the explicit products (``SMALL_ATTENTION`` on a CPU, and
    always for a model that soft-caps its scores, which SDPA cannot) rather than SDPA."""
    return (device.type == "cpu" and L * S <= SMALL_ATTENTION) or getattr(cfg, "attn_logit_softcapping", None) is not None


def _layer_masks(hf_model: nn.Module, full_am: torch.Tensor, cache: LeanCache | None, past: int, L: int, Hkv: int,
                 rep: int, dtype: torch.dtype, small: bool, width: int = 0) -> tuple[list, dict]:
    """(each layer's window key, {key: ``_attention_masks``}): a window at least as wide as the
    sequence masks nothing, so those layers share the unwindowed masks (key None)."""
    windows = [None if w is None or w >= full_am.size(1) else w for w in layer_windows(hf_model)]
    return windows, {w: _attention_masks(full_am, cache, past, L, Hkv, rep, dtype, small, w, width) for w in set(windows)}


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
