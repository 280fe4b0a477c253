"""bf16 copies of the weights for CPU bf16 autocast: a ``bf16_weights()`` region in which each weight
that needs no gradient is cast to bf16 once (and stacked, and prepacked for oneDNN, where the
products read it so), instead of at every product. The copies of frozen weights are kept across
regions while the weights live unchanged (``_KEPT``); every copy is keyed by its weights' identity
and version (``_stamp``), so a changed weight is copied again."""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
import torch.nn as nn

from .packs import _packed_linear_ok


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
would otherwise copy all of them again and pack the head again."""


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

    def decode_plan(self, mods: tuple[nn.Module, ...], make):
        """``make(self, mods)``: what ``linear`` / ``_stacked_linear`` read for ``mods`` in a
        no-gradient decode step (copies, packs, LoRA factors, or None: the module runs itself; which
        pack serves at a row count the plan says itself, ``products._Choice``), made at the first
        step of a region and served to its later steps, at any row count, while the modules are the same
        objects, their weights unchanged (``_stamp``) and nothing else it rests on changed
        (``_plan_state``: hooks, requires_grad, a LoRA Linear's adapter state). Making it looks each
        copy and pack up again, several Python calls a weight, a noticeable share of a decode step
        if done at every step (see docs/performance.md)."""
        key = (make, tuple(map(id, mods)))
        hit = self.plans.get(key)
        if hit is not None:
            held, subs, tensors, stamp, state, made = hit
            if (all(a is b for a, b in zip(held, mods)) and _stamp(tensors) == stamp
                    and _plan_state(mods, subs, tensors) == state):
                return made
        subs, tensors = _plan_parts(mods)
        made = make(self, mods)
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
        out for ``rows`` rows (any row count may use it, at about the same speed: see
        docs/performance.md); None where a copy would not serve or oneDNN's bf16 linear is
        unavailable (``_packed_linear_ok``)."""
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

    def packed_stack_with(self, ws: tuple[torch.Tensor, ...], factors: tuple[torch.Tensor, ...],
                          rows: int) -> torch.Tensor | None:
        """``packed_stack`` of ``ws`` with the bf16 copies of ``factors`` (each (r, K): a LoRA policy's A
        factors, which read the same input) stacked after them: one prepacked product for the frozen
        base weights and the factors. Factors that train change between regions, so such a pack is
        made in each region and freed at its end (kept, like ``packed_stack``, where every weight is
        frozen); the kept stack of ``ws`` is its source, and no pack of ``ws`` alone is made."""
        if not _packed_linear_ok() or any(w.requires_grad and torch.is_grad_enabled() for w in ws + factors):
            return None
        store, kind = self._store(ws + factors), f"stack+ pack {rows}"
        hit = store.find(kind, ws + factors)
        if hit is not None:
            return hit
        stack, copies = self.stacked(ws), [self.get(A) for A in factors]
        if stack is None or any(c is None or c.size(1) != stack.size(1) for c in copies):
            return None
        return store.put(kind, ws + factors,
                         torch.ops.mkldnn._reorder_linear_weight(torch.cat([stack, *copies]), rows))


@contextlib.contextmanager
def bf16_weights():
    """A region in which the lean forward's products under CPU bf16 autocast read each weight that
    needs no gradient from a bf16 copy made once in the region (``linear``), instead of casting it
    again at every call: torch.autocast caches its casts of leaf tensors that require grad only, so
    the frozen base weights of a LoRA policy would be cast anew for every product, a large share of
    a sampling call's time (see docs/performance.md). rlvr.run's autocast context
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
