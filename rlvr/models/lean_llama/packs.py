"""oneDNN's prepacked bf16 linear: a weight reordered once into oneDNN's blocked layout, then
multiplied without reordering it at every call. Used only where a probe shows it gives
``F.linear``'s bf16 products to the last bit (``_packed_linear_ok`` once per process, ``_pack_ok``
per shape and row count), so autocast's numbers are kept."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .limits import PACK_ROWS


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


def _packed_linear(x: torch.Tensor, Wp: torch.Tensor, bb: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T (+ bb)`` (rows, N) for a bf16 x (rows, K) from W's prepacked bf16 copy ``Wp``."""
    return torch.ops.mkldnn._linear_pointwise(x, Wp, bb, "none", [], "")


_PACK_OK_AT: dict[tuple, bool] = {}


def _pack_ok(Wp: torch.Tensor, Wbs: tuple[torch.Tensor, ...], bbs: tuple[torch.Tensor | None, ...], rows: int) -> bool:
    """Whether a product on ``rows`` rows from ``Wp``, the prepacked (``PACK_ROWS``) bf16 weights
    ``Wbs`` (each (N_i, K); several stacked, ``_Bf16Weights.packed_stack``), gives each weight's
    ``F.linear`` bf16 product (with its bf16 bias ``bbs[i]``, the stack's bias 0 where None) to the
    last bit: autocast's numbers. oneDNN picks its kernel, and so its order of summation, by the
    shapes, and a pack's product may take another kernel than ``F.linear`` at some shapes and row
    counts (see docs/performance.md). So each (shapes, biases, rows) is probed once per process on
    the weights at hand and a random input (two products at that row count, paid once for each row
    count a run's decode steps reach); where it fails the caller computes ``F.linear``."""
    key = (tuple(W.size(0) for W in Wbs), Wbs[0].size(1), rows, tuple(b is not None for b in bbs))
    ok = _PACK_OK_AT.get(key)
    if ok is None:
        x = torch.randn(rows, key[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        bias = (torch.cat([torch.zeros(W.size(0), dtype=torch.bfloat16) if b is None else b for W, b in zip(Wbs, bbs)])
                if any(key[3]) else None)
        want = torch.cat([F.linear(x, W, b) for W, b in zip(Wbs, bbs)], dim=1)
        ok = _PACK_OK_AT[key] = torch.equal(_packed_linear(x, Wp, bias), want)
    return ok
