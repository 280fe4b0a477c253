"""Weight-major products for decode steps: ``W @ x.T`` instead of ``x @ W.T`` on few rows without
gradient on the CPU, which BLAS runs faster at those row counts, with plain LoRA adapters unrolled
in peft's order. Under CPU bf16 autocast they read the ``bf16_weights()`` copies (q/k/v and gate/up
each in one product from stacked copies) where this CPU's bf16 products round alike in both
layouts (``_weight_major_bf16_ok``), so the numbers are autocast's."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .bf16_copies import _SCOPE, _bf16_copy, _cpu_bf16_autocast
from .limits import HEAD_ROWS
from .modules import _act, _gate_up_mods, _hooked, _plain_lora, _stock_mlp


def linear_t(m: nn.Module, xT: torch.Tensor) -> torch.Tensor:
    """``m(xT.t()).t()``: (N, rows) from (K, rows), for few rows without gradient.

    An ``nn.Linear`` (or a plain peft LoRA ``Linear``, see ``_plain_lora``) is computed as
    ``W @ xT`` (``b + W @ xT`` in one ``addmm`` with a bias, as ``F.linear`` adds it; then
    ``+ B @ (A @ xT) * scaling`` per adapter, peft's order; one ``addmm`` when the scaling is a power
    of two, where scaling the product is exact): on CPU at decode's row counts BLAS runs this
    weight-major product faster than ``x @ W.T`` (see docs/performance.md); the same sums, equal to
    the last bit at 1 and at 12-256 rows (MKL rounds 2-11 rows differently), and its (N, rows)
    output feeds the next weight-major product without a copy (at 2-11 rows a contiguous float32
    operand is read as the transposed view of its copy, ``_operand_t``). Anything else (a module
    with forward hooks included, so that hooks see every call) runs the module and transposes its
    output (a view).

    A bf16 ``xT`` (under CPU bf16 autocast, ``_weight_major``) takes ``_linear_t_bf16``."""
    if xT.dtype == torch.bfloat16:
        return _linear_t_bf16(m, xT)
    xT = _operand_t(xT)
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


TRANSPOSED_OPERAND_ROWS = (2, 11)
"""The row counts (lowest, highest) at which ``linear_t`` hands MKL a contiguous float32 (K, rows)
operand as the transposed view of a (rows, K) copy (``_operand_t``): at these counts MKL's product
with a contiguous operand took a slower kernel than with the transposed view, by more than the
copy costs, and both round unlike the row-major product, so the bits promised (1 and 12+ rows)
are unchanged (figures: docs/performance.md, "Transposed operand at 2-11 rows"). A decode step's
first products of a layer (q/k/v, gate/up, o_proj) already read such a view; down_proj reads the
MLP's contiguous product. None: never."""


def _operand_t(xT: torch.Tensor) -> torch.Tensor:
    """``xT`` (K, rows), as the transposed view of a row-major (rows, K) copy where it is a contiguous
    float32 tensor of ``TRANSPOSED_OPERAND_ROWS`` rows (a copy of rows x K elements), else itself."""
    span = TRANSPOSED_OPERAND_ROWS
    if (span is not None and span[0] <= xT.size(1) <= span[1] and xT.dtype == torch.float32
            and xT.stride(1) == 1 and xT.stride(0) == xT.size(1)):
        return xT.t().contiguous().t()
    return xT


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
    or a copy would not serve; the caller then runs ``linear_t``. One larger product takes less
    time than several small ones (see docs/performance.md). Biases (Qwen 2's q/k/v)
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
    hands the next) against ``F.linear(y, Wb[, bb]).t()`` for the contiguous (rows, K) ``y``, on a
    probe of SmolLM2's MLP shape at 8 and 64 rows; checked once per process. Where oneDNN computes
    bf16 products (native bf16 instructions) both layouts round alike; on a CPU without them the
    products can depend on the operands' layout (see docs/performance.md), so the decode steps
    there keep autocast's row-major products."""
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
