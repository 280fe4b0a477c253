"""Dropping rows from a KV cache mid-decode: what lets ``rlvr.sampling`` stop computing rows that ended.

``keep_rows(cache, rows)`` keeps the rows ``rows`` (n,) long, ascending, of any rlvr cache, in place,
and returns the rows it actually kept (a superset of ``rows``, ascending), or None where the cache
cannot drop rows (the caller then keeps computing every row):

- a cache with a ``keep_rows`` method (the built-in model's ``KVCache``, ``HFCache``) does it itself;
- a ``LeanCache`` (the lean forward's) is handled here: in its plain layout each layer's keys and
  values are narrowed to the kept rows; in its grouped layout (a prompt's G rows share the prompt's
  columns and interleave their own, see ``LeanCache``) a row cannot leave its group alone, so the
  groups that still hold a kept row are kept whole and their rows returned.

In both layouts the kept rows' filled columns move to the front of the same preallocated buffers
(no new allocation of the ``max_len`` columns); the buffers keep their memory until the call ends.
"""

from __future__ import annotations

import torch

from rlvr.models.lean_llama import LeanCache


def keep_rows(cache, rows: torch.Tensor) -> torch.Tensor | None:
    """Keep ``rows`` (n,) long ascending of ``cache`` in place; the (n',) rows kept, or None (see module)."""
    method = getattr(cache, "keep_rows", None)
    if method is not None:
        return method(rows)
    if isinstance(cache, LeanCache):
        return _lean_keep_rows(cache, rows)
    return None


def group_rows(rows: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(groups (m,), their rows (m * group,)): the groups of ``group`` consecutive rows that hold one
    of ``rows`` (n,) ascending, and every row of those groups, ascending."""
    groups = torch.unique_consecutive(torch.div(rows, group, rounding_mode="floor"))       # (m,)
    return groups, (groups[:, None] * group + torch.arange(group, device=rows.device)).view(-1)


def _narrow_rows(buf: torch.Tensor, idx: torch.Tensor, cols: tuple) -> torch.Tensor:
    """``buf``'s rows ``idx`` (dim 0) moved to its first rows over the filled columns ``cols``
    (an index tuple for dims 1...), as a view of the first len(idx) rows of ``buf``."""
    n = idx.numel()
    buf[(slice(0, n), *cols)] = buf[(idx, *cols)]                                   # the gather copies first
    return buf[:n]


def _lean_keep_rows(cache: LeanCache, rows: torch.Tensor) -> torch.Tensor:
    """``keep_rows`` for a ``LeanCache`` (module docstring)."""
    if cache.group > 1:
        idx, rows = group_rows(rows, cache.group)        # whole groups: (P', ) prompts, (P' * G,) rows
        if rows.numel() == cache.batch_size:
            return rows
    else:
        idx = rows
    for li, k in enumerate(cache.k):
        if k is None:
            continue
        if cache._kbuf[li] is None:                      # grown by torch.cat (with gradient): plain copies
            cache.k[li], cache.v[li] = k[idx], cache.v[li][idx]
            continue
        S = cache.v[li].size(2)
        if cache.group > 1:                              # keys transposed: (P, Hkv, D, cols)
            cache._kbuf[li] = _narrow_rows(cache._kbuf[li], idx, (slice(None), slice(None), slice(0, S)))
            cache.k[li] = cache._kbuf[li][..., :S]
        else:                                            # (B, Hkv, max_len, D)
            cache._kbuf[li] = _narrow_rows(cache._kbuf[li], idx, (slice(None), slice(0, S)))
            cache.k[li] = cache._kbuf[li][:, :, :S]
        cache._vbuf[li] = _narrow_rows(cache._vbuf[li], idx, (slice(None), slice(0, S)))
        cache.v[li] = cache._vbuf[li][:, :, :S]
    cache.mask, cache.next_pos = cache.mask[rows], cache.next_pos[rows]
    return rows
