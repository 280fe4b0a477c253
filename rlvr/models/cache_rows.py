"""Dropping rows from a KV cache mid-decode: what lets ``rlvr.sampling`` stop computing rows that ended.

``keep_rows(cache, rows)`` keeps the rows ``rows`` (n,) long, ascending, of any rlvr cache, in place,
and returns the rows it actually kept in their new order (row j of the cache is now the old row
``kept[j]``; a superset of ``rows``), or None where the cache cannot drop rows (the caller then
keeps computing every row):

- a cache with a ``keep_rows`` method (the built-in model's ``KVCache``, ``HFCache``) does it itself;
- a ``LeanCache`` (the lean forward's) is handled here: in its plain layout each layer's keys and
  values are narrowed to the kept rows; in its grouped layout (a prompt's G rows share the prompt's
  columns and interleave their own, see ``LeanCache``) a row cannot leave its group alone, so the
  groups that still hold a kept row are kept whole and their rows returned, unless ``exact``: the
  kept rows then leave the grouped layout (``ungroup``: each gets its own copy of its prompt's
  columns) and every other row is dropped.

Both layouts fill holes (``fill_holes``): the kept rows (or groups) past the first n move into the
places of the dropped ones below, so a drop copies at most as many rows as it drops, not every
kept row, and the rows' order changes. The buffers are the same preallocated ones (no new
allocation of the ``max_len`` columns; they keep their memory until the call ends), except after
``ungroup``, which allocates the plain layout's for the kept rows.

``rows_copied(cache, rows)`` says how many rows' cache columns ``keep_rows(cache, rows, exact=True)``
would copy: what ``rlvr.sampling`` weighs a drop's cost by; ``drops_groups(cache)`` whether a
cheaper drop of whole groups is on offer.
"""

from __future__ import annotations

import torch

from rlvr.models import lean_llama
from rlvr.models.lean_llama import LeanCache


def keep_rows(cache, rows: torch.Tensor, exact: bool = False) -> torch.Tensor | None:
    """Keep ``rows`` (n,) long ascending of ``cache`` in place; the (n',) rows kept in their new order,
    or None (see module). ``exact``: a grouped ``LeanCache`` keeps ``rows`` only (``ungroup``)."""
    method = getattr(cache, "keep_rows", None)
    if method is not None:
        return method(rows)
    if isinstance(cache, LeanCache):
        if exact and cache.group > 1 and not _whole_groups(rows, cache.group):
            return ungroup(cache, rows)
        return _lean_keep_rows(cache, rows)
    return None


def rows_copied(cache, rows: torch.Tensor) -> int:
    """The rows whose cache columns ``keep_rows(cache, rows, exact=True)`` copies: the kept rows
    that fill holes (``fill_holes``), every kept row where the cache compacts them all (a cache
    with its own ``keep_rows`` and no ``fill_holes``: ``HFCache``) or leaves the grouped layout."""
    own = getattr(cache, "keep_rows", None)
    if own is not None:
        return int((rows >= rows.numel()).sum()) if getattr(cache, "fills_holes", False) else rows.numel()
    if isinstance(cache, LeanCache) and cache.group > 1:
        G = cache.group
        if not _whole_groups(rows, G):
            return rows.numel()
        groups = torch.unique_consecutive(torch.div(rows, G, rounding_mode="floor"))
        return G * int((groups >= groups.numel()).sum())
    return int((rows >= rows.numel()).sum())


def drops_groups(cache) -> bool:
    """Whether ``keep_rows(cache, rows)`` without ``exact`` keeps whole groups (a ``LeanCache`` in the
    grouped layout): a cheaper drop than an exact one, of the groups whose every row is dropped."""
    return isinstance(cache, LeanCache) and cache.group > 1


def fill_holes(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How to keep ``rows`` (k,) long ascending, of rows 0 ... n-1, as rows 0 ... k-1 with fewest
    copies: the kept rows at k or after move into the dropped rows' places below k, in order.
    Returns (order (k,): the old row now at each place, dst (m,), src (m,): the moves, m <= the rows
    dropped)."""
    k = rows.numel()
    dst = torch.ones(k, dtype=torch.bool, device=rows.device)
    dst[rows[rows < k]] = False
    dst = dst.nonzero().squeeze(1)                                                 # (m,) the holes below k
    src = rows[rows >= k]                                                          # (m,) the kept rows past k
    order = torch.arange(k, device=rows.device)
    order[dst] = src
    return order, dst, src


def group_rows(rows: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(groups (m,), their rows (m * group,)): the groups of ``group`` consecutive rows that hold one
    of ``rows`` (n,) ascending, and every row of those groups, ascending."""
    groups = torch.unique_consecutive(torch.div(rows, group, rounding_mode="floor"))       # (m,)
    return groups, _expand_groups(groups, group)


def _expand_groups(groups: torch.Tensor, group: int) -> torch.Tensor:
    """(m * group,) every row of ``groups`` (m,), group by group."""
    return (groups[:, None] * group + torch.arange(group, device=groups.device)).view(-1)


def _whole_groups(rows: torch.Tensor, group: int) -> bool:
    """Whether ``rows`` (n,) ascending are whole groups of ``group`` consecutive rows."""
    return group_rows(rows, group)[1].numel() == rows.numel()


def _move_rows(buf: torch.Tensor, order: torch.Tensor, dst: torch.Tensor, src: torch.Tensor,
               cols: tuple) -> torch.Tensor:
    """``buf``'s rows ``src`` (dim 0) copied to rows ``dst`` over the filled columns ``cols`` (an index
    tuple for dims 1...), as a view of the first len(order) rows of ``buf`` (``fill_holes``)."""
    if dst.numel():
        buf[(dst, *cols)] = buf[(src, *cols)]                                      # the gather copies first
    return buf[:order.numel()]


def _lean_keep_rows(cache: LeanCache, rows: torch.Tensor) -> torch.Tensor:
    """``keep_rows`` for a ``LeanCache`` without ``exact`` (module docstring)."""
    if cache.group > 1:
        groups, rows = group_rows(rows, cache.group)        # whole groups: (P',) prompts, (P' * G,) rows
        if rows.numel() == cache.batch_size:
            return rows
        order, dst, src = fill_holes(groups)                # (P',) groups in their new order
        rows = _expand_groups(order, cache.group)           # (P' * G,)
    else:
        order, dst, src = fill_holes(rows)
        rows = order
    for li, k in enumerate(cache.k):
        if k is None:
            continue
        if cache._kbuf[li] is None:                      # grown by torch.cat (with gradient): plain copies
            idx = order if cache.group > 1 else rows
            cache.k[li], cache.v[li] = k[idx], cache.v[li][idx]
            continue
        S = cache.v[li].size(2)
        if cache.group > 1:                              # keys transposed: (P, Hkv, D, cols)
            cache._kbuf[li] = _move_rows(cache._kbuf[li], order, dst, src, (slice(None), slice(None), slice(0, S)))
            cache.k[li] = cache._kbuf[li][..., :S]
        else:                                            # (B, Hkv, D, cols) or (B, Hkv, cols, D)
            transposed = cache.keys_transposed(cache._vbuf[li].size(2))
            cols = (slice(None), slice(None), slice(0, S)) if transposed else (slice(None), slice(0, S))
            cache._kbuf[li] = _move_rows(cache._kbuf[li], order, dst, src, cols)
            cache.k[li] = cache.key_view(li, S)
        cache._vbuf[li] = _move_rows(cache._vbuf[li], order, dst, src, (slice(None), slice(0, S)))
        cache.v[li] = cache._vbuf[li][:, :, :S]
    cache.mask, cache.next_pos = cache.mask[rows], cache.next_pos[rows]
    return rows


def ungroup(cache: LeanCache, rows: torch.Tensor) -> torch.Tensor:
    """Keep ``rows`` (n,) long ascending of a ``LeanCache`` in the grouped layout as rows 0 ... n-1 of
    its plain layout, in place; returns ``rows``. Each kept row gets its own copy of its prompt's
    columns followed by its own (column ``prefix + s * G + g`` of its group's is its step s), in
    new buffers of the plain layout (values (n, Hkv, cols, D), keys as ``LeanCache.keys_transposed``
    says for that width, ``CACHE_GROW`` columns to spare: the grouped layout is a CPU one);
    the grouped ones are let go. What lets a row leave its group: a decode step then attends as
    with a cache repeated G times from the start."""
    G, pre = cache.group, cache.prefix
    n_steps = cache.length - pre
    p, g = torch.div(rows, G, rounding_mode="floor"), rows % G                   # (n,) prompt, sample
    cols = min(cache.max_len, pre + n_steps + lean_llama.CACHE_GROW)   # LeanCache.spare_cols' spare columns
    transposed = cache.keys_transposed(cols)
    for li, kT in enumerate(cache.k):
        v = cache.v[li]                                        # (P, Hkv, pre + G * n_steps, D)
        P, Hkv, D, _ = kT.shape
        vb = v.new_zeros(rows.numel(), Hkv, cols, D)
        kb = kT.new_zeros(rows.numel(), Hkv, D, cols) if transposed else torch.zeros_like(vb)
        kt = kb if transposed else kb.transpose(2, 3)          # (n, Hkv, D, cols) either way
        kt[..., :pre] = kT[p, :, :, :pre]
        vb[:, :, :pre] = v[p, :, :pre]
        own_k = kT[..., pre:].view(P, Hkv, D, n_steps, G)      # step s, row g at s * G + g
        own_v = v[:, :, pre:].view(P, Hkv, n_steps, G, D)
        kt[..., pre:pre + n_steps] = own_k[p, :, :, :, g]      # (n, Hkv, D, n_steps)
        vb[:, :, pre:pre + n_steps] = own_v[p, :, :, g]
        cache._kbuf[li], cache._vbuf[li] = kb, vb
    cache.group, cache.prefix, cache.spare_cols = 1, 0, True
    for li in range(len(cache.k)):
        cache.k[li], cache.v[li] = cache.key_view(li, pre + n_steps), cache._vbuf[li][:, :, :pre + n_steps]
    cache.mask, cache.next_pos = cache.mask[rows], cache.next_pos[rows]
    return rows


def takes_rows(cache) -> bool:
    """Whether ``take_rows`` can give rows of ``cache``: a ``LeanCache`` in its plain layout."""
    return isinstance(cache, LeanCache) and cache.group == 1


def take_rows(cache: LeanCache, rows: torch.Tensor) -> LeanCache:
    """A new cache holding ``rows`` (n,) long of ``cache`` (``takes_rows``; rows may repeat), its keys
    and values indexed out of place so gradients reach the source's (a training forward's buckets
    over their rows' shared prompts, rlvr.scoring.sequence_token_logprobs)."""
    out = LeanCache(len(cache.k), rows.numel(), cache.max_len, rows.device)
    out.k = [None if t is None else t[rows] for t in cache.k]
    out.v = [None if t is None else t[rows] for t in cache.v]
    out.mask, out.next_pos = cache.mask[rows], cache.next_pos[rows]
    return out
