"""Row-major products under CPU bf16 autocast: ``linear`` computes ``m(x)`` from the ``bf16_weights()``
copies (autocast's numbers, without casting the weights at every call), and a no-gradient decode
step on few rows reads frozen weights from their oneDNN packs (``decode_reads_packs``; q/k/v and
gate/up each from one stacked pack, ``_stacked_linear``); the head from its pack (``_packed_head``).
Outside a region, or off the CPU, the module runs itself."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .bf16_copies import _SCOPE, _Bf16Weights, _cpu_bf16_autocast
from .limits import HEAD_ROWS, PACK_ROWS
from .modules import _hooked, _plain_lora
from .packs import _pack_ok, _packed_linear, _packed_linear_ok
from .weight_major import _add_lora_bf16, _weight_major_bf16_ok


def decode_reads_packs() -> bool:
    """Whether bf16 decode steps on this CPU read every frozen weight from a prepacked copy kept
    with its bf16 copy (``linear``): where decode's products run row-major (``_weight_major_bf16_ok``
    fails) and oneDNN's packed linear serves (``_packed_linear_ok``). Elsewhere only the head is packed."""
    return _packed_linear_ok() and not _weight_major_bf16_ok()


class _Choice:
    """The packs a decode plan may read for its modules, in order of preference, each with the
    arguments ``_pack_ok`` compares its product by (``options``: (pack, what serves with it,
    ``_pack_ok``'s weights and biases)), and which one serves at a row count: the first whose product
    gives each weight's own bits there (``_pack_ok``; None where none does), remembered per row count
    (``at``), so that a plan made once a region serves every row count its decode steps reach
    without being made again (rows leave a sampling call's batch as they end)."""

    __slots__ = ("options", "at")

    def __init__(self, options: tuple[tuple, ...]):
        self.options, self.at = options, {}

    def __call__(self, rows: int) -> tuple | None:
        """(pack, what serves with it) at ``rows`` rows, or None."""
        got = self.at.get(rows, self)
        if got is self:
            got = self.at[rows] = next((o[:2] for o in self.options if _pack_ok(o[0], *o[2], rows)), None)
        return got


def _stacked_plan(scope: "_Bf16Weights", mods: tuple[nn.Module, ...]) -> tuple | None:
    """(a ``_Choice`` of stacked packs, [(base weight, base bias, [(A, B, scaling), ...]) per
    module]) that ``_stacked_linear`` reads for ``mods``, or None where it does not serve (see
    there). Each option serves (its stacked bias or None, each output block's width, whether the
    LoRA A factors are in the pack, each adapter's B as its bf16 copy transposed (r, N) where they
    are (else None), per module). The A factors read the same input as the bases, so the stack with
    them (their products the last blocks, in the adapters' order) is preferred where ``_pack_ok``
    says that product rounds as each factor's own at the rows; else the pack of the bases alone."""
    plans = []
    for m in mods:
        plan = (m.weight, m.bias, []) if type(m) is nn.Linear and not _hooked(m) else _plain_lora(m, torch.float32)
        if plan is None or plan[0].requires_grad or (plan[1] is not None and plan[1].requires_grad):
            return None
        plans.append(plan)
    ws, bs = tuple(W for W, _, _ in plans), tuple(b for _, b, _ in plans)
    factors = tuple(A for _, _, adapters in plans for A, _, _ in adapters)
    options = []
    for extra in ((factors, ()) if factors else ((),)):
        packed = _stack_pack(scope, ws, bs, extra)
        if packed is not None:
            Wp, bb, sizes, checked = packed
            bts = tuple(tuple(_copy_t(scope, B) if extra else None for _, B, _ in adapters) for _, _, adapters in plans)
            options.append((Wp, (bb, sizes, bool(extra), bts), checked))
    return (_Choice(tuple(options)), plans) if options else None


def _copy_t(scope: "_Bf16Weights", B: torch.Tensor) -> torch.Tensor | None:
    """B's bf16 copy in the region, transposed (a view), or None where a copy would not serve."""
    Bb = scope.get(B)
    return None if Bb is None else Bb.t()


def _stack_pack(scope: "_Bf16Weights", ws: tuple[torch.Tensor, ...], bs: tuple[torch.Tensor | None, ...],
                factors: tuple[torch.Tensor, ...]) -> tuple | None:
    """(pack, stacked bias or None, each block's width, (each weight's bf16 copy, each bias's or None):
    what ``_pack_ok`` compares the pack's product with) of the base weights ``ws`` (biases ``bs``)
    stacked with the bias-free ``factors``; None where no pack serves."""
    sizes = tuple(W.size(0) for W in ws + factors)
    biases = bs + (None,) * len(factors)
    Wp = scope.packed_stack_with(ws, factors, PACK_ROWS) if factors else scope.packed_stack(ws, PACK_ROWS)
    bb = scope.stacked_bias(biases, sizes) if any(b is not None for b in bs) else None
    if Wp is None or (bb is None and any(b is not None for b in bs)):
        return None
    checked = tuple(map(scope.get, ws + factors)), tuple(None if b is None else scope.get(b) for b in biases)
    return Wp, bb, sizes, checked


def _stacked_linear(mods: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor] | None:
    """``[linear(m, x) for m in mods]`` for modules that read the same ``x`` (..., K) (q/k/v; gate/up)
    in a row-major bf16 decode step (``decode_reads_packs``: no gradient, at most ``HEAD_ROWS`` rows,
    CPU bf16 autocast in a ``bf16_weights()`` region), from ONE product with the prepacked stack of
    their frozen base weights (``_Bf16Weights.packed_stack``, kept across regions), each output a
    column block of it; LoRA terms then added per module as ``linear`` adds them (the factors under
    autocast, as peft calls them), the A factors' products read from the same product where they
    joined the stack (``_Bf16Weights.packed_stack_with``, made once a region). The same bits as
    ``linear``'s products where ``_pack_ok`` says the stacked product gives them; None elsewhere (a
    module not a plain Linear or plain LoRA Linear, a base weight that trains, no pack): the caller
    runs ``linear``. One stacked product saves a little of a decode step over one per module, and
    the A factors in it two small products and two casts of x a layer (see docs/performance.md).
    With the A factors in the stack, each B product is one ``mm`` with B's bf16 copy (the product
    autocast makes of ``F.linear(h, B)``, the same kernel on the same operands) added into its block
    in place (``_add_lora_bf16``: the same bf16 sum): four calls a factor fewer than ``F.linear``'s
    views, the scaling and the sum apart."""
    scope = getattr(_SCOPE, "weights", None)
    rows = x.numel() // x.size(-1)
    if (scope is None or torch.is_grad_enabled() or rows > HEAD_ROWS or not _cpu_bf16_autocast(x.device)
            or not decode_reads_packs()):
        return None
    plan = scope.decode_plan(mods, _stacked_plan)
    served = None if plan is None else plan[0](rows)
    if served is None:
        return None
    Wp, (bb, sizes, factored, bts) = served
    plans = plan[1]
    x2 = x.reshape(rows, x.size(-1))                                             # (rows, K)
    out = _packed_linear(x2.to(torch.bfloat16), Wp, bb)                          # (rows, sum of sizes)
    blocks = out.split(sizes, dim=1)
    down = iter(blocks[len(plans):])                # the A factors' products (factored), adapters' order
    outs = []
    for block, (_, _, adapters), bt in zip(blocks, plans, bts):
        for (A, B, scaling), Bt in zip(adapters, bt):   # as linear adds them (under autocast, as peft calls them)
            if factored and Bt is not None:              # block is this product's own: added in place
                _add_lora_bf16(block, torch.mm(next(down), Bt), scaling)
            else:
                block = block + F.linear(next(down) if factored else F.linear(x2, A), B) * scaling
        outs.append(block.view(*x.shape[:-1], block.size(1)))
    return outs


def _packed_head(head: nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """``head(x)`` (rows, V) for x (rows, d) under CPU bf16 autocast inside ``bf16_weights()``
    without gradient, from the head's prepacked bf16 copy (``_Bf16Weights.packed``): the bf16
    product autocast computes, equal to the last bit (probed, and tested), faster than ``F.linear``
    on the plain copy, which reorders the weight at every call (see docs/performance.md). None
    elsewhere."""
    scope = getattr(_SCOPE, "weights", None)
    if scope is None or not _cpu_bf16_autocast(x.device) or torch.is_grad_enabled() or _hooked(head):
        return None
    Wp = scope.packed(head.weight, PACK_ROWS)
    if Wp is None or not _pack_ok(Wp, (scope.get(head.weight),), (None,), x.size(0)):
        return None
    return _packed_linear(x.to(torch.bfloat16), Wp, None)


def _linear_plan(scope: "_Bf16Weights", mods: tuple[nn.Module], pack: bool = True) -> tuple | None:
    """(W's bf16 copy, its bias's or None, a ``_Choice`` of W's prepacked copy where ``pack`` (a
    no-gradient decode call) and W is frozen, else None; the LoRA adapters [(A, B, scaling), ...])
    that ``linear`` computes ``mods[0]`` from, or None where the module runs itself (hooks, not a
    plain Linear or plain LoRA Linear, a weight that needs a gradient here)."""
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
    Wp = scope.packed(W, PACK_ROWS) if pack and not W.requires_grad and not torch.is_grad_enabled() else None
    return Wb, bb, None if Wp is None else _Choice(((Wp, None, ((Wb,), (bb,))),)), adapters


def linear(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``m(x)``; inside ``bf16_weights()`` under bf16 autocast on the CPU, an ``nn.Linear`` (or a
    plain peft LoRA ``Linear``'s base layer, see ``_plain_lora``) takes its weight and bias from the
    region's bf16 copies when they need no gradient: what autocast computes (the input cast to bf16,
    a bf16 product with the bf16 bias; LoRA factors under autocast as peft calls them), equal to the
    last bit (tested). Without gradient on at most ``HEAD_ROWS`` rows (row-major decode steps) a
    frozen weight (``_KEPT``: packed once, kept across regions) is read from its prepacked copy
    (``_packed_linear``, where ``_packed_linear_ok`` and ``_pack_ok`` at these rows say it gives the
    same bits; ``_stacked_linear`` reads q/k/v and gate/up from stacked packs): faster products,
    and only frozen weights are packed, since a pack made again in every region costs what it saves
    (see docs/performance.md)."""
    scope = getattr(_SCOPE, "weights", None)
    if (scope is None or x.device.type != "cpu" or not torch.is_autocast_enabled("cpu")
            or torch.get_autocast_dtype("cpu") != torch.bfloat16):
        return m(x)
    rows = x.numel() // x.size(-1)
    decode = rows <= HEAD_ROWS and not torch.is_grad_enabled()
    plan = scope.decode_plan((m,), _linear_plan) if decode else _linear_plan(scope, (m,), pack=False)
    if plan is None:
        return m(x)
    Wb, bb, packs, adapters = plan
    served = None if packs is None else packs(rows)                  # (W's pack, None) where it serves
    if served is not None:
        out = _packed_linear(x.reshape(rows, x.size(-1)).to(torch.bfloat16), served[0], bb).view(*x.shape[:-1], -1)
    else:
        out = F.linear(x.to(torch.bfloat16), Wb, bb)
    for A, B, scaling in adapters:     # x cast again by autocast, as peft calls it: the same gradient sums
        out = out + F.linear(F.linear(x, A), B) * scaling
    return out
