"""AdamW over one flat buffer: the same update as torch's fused AdamW, one kernel call per step.

torch's fused AdamW on a CPU pays a fixed cost per parameter tensor (its Python bookkeeping, one
step counter per tensor, one parallel region per tensor), which for the many small LoRA tensors of
a real model costs several times what reading and writing their weights, gradients and two moments
takes at the machine's copy bandwidth (figures: docs/benchmarks.md). `FlatAdamW`
moves those parameters into one flat buffer (each parameter a view of its slice), their gradients
into another and keeps the two moments flat, so a step is one fused call over one tensor.

Same numbers: the fused kernel is elementwise and vectorised, with a scalar loop for the last
elements of each tensor that do not fill a vector. `flat_fits` therefore takes only tensors whose
sizes are multiples of `FLAT_ALIGN`, where the flat update is torch's bit for bit
(tests/test_optim.py); anything else keeps torch's AdamW over the list. Parameters that are views
of one buffer save as before: rlvr.state, safetensors and transformers copy views that share memory
without overlapping.
"""

from __future__ import annotations

import torch

FLAT_ALIGN = 64
"""Every parameter's element count must be a multiple of this (a whole number of vectors of any
CPU's float kernels) for `FlatAdamW`, so that no element falls in a different (scalar) code path."""

FLAT_MAX = 1 << 24
"""Most trainable elements `FlatAdamW` takes (16.8M: 64 MiB of fp32). Its gradient buffer stays
allocated between steps; above this the per-tensor cost is small next to the step's memory traffic
and torch's AdamW over the list is used."""


def flat_fits(params: list[torch.nn.Parameter]) -> bool:
    """True when `FlatAdamW` takes `params`: at least two distinct plain fp32 CPU tensors (no DTensor
    shards), each a multiple of FLAT_ALIGN elements, FLAT_MAX in all."""
    return (len(params) >= 2 and len({id(p) for p in params}) == len(params)
            and sum(p.numel() for p in params) <= FLAT_MAX
            and all(type(p.data) is torch.Tensor and p.device.type == "cpu" and p.dtype == torch.float32
                    and p.numel() % FLAT_ALIGN == 0 for p in params))


class FlatAdamW(torch.optim.AdamW):
    """Fused AdamW over one flat buffer holding `params` (see the module docstring); for the caller it
    is AdamW over the list.

    - Weights: each parameter's ``.data`` becomes a view of its slice of ``flat``, so the step
      updates them in place. A parameter whose data something replaced (``p.data = ...``) is copied
      in and made a view again at the next step.
    - Gradients: each ``.grad`` is a view into one flat buffer (autograd adds into an existing
      ``.grad`` in place); ``zero_grad`` zeroes that buffer whatever ``set_to_none`` says, so a
      parameter that got no gradient counts as a zero gradient (torch skips a ``None`` one). A
      ``.grad`` that something replaced is copied in at the next step.
    - ``state_dict`` / ``load_state_dict`` use the per-parameter format of AdamW over the list (state
      keyed 0..n-1, one group), so saved states load into either.
    """

    def __init__(self, params: list[torch.nn.Parameter], **kw):
        self.members = list(params)
        sizes = [p.numel() for p in self.members]
        self.flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in self.members]))
        super().__init__([self.flat], fused=True, **kw)   # first: a torch without the fused kernel raises here,
        self.flat.grad = torch.zeros_like(self.flat)      # before any parameter is touched
        self._weights = [w.view_as(p) for w, p in zip(self.flat.detach().split(sizes), self.members)]
        self._grads = [g.view_as(p) for g, p in zip(self.flat.grad.split(sizes), self.members)]
        with torch.no_grad():
            for p, w, g in zip(self.members, self._weights, self._grads):
                p.data = w
                p.grad = g
        self._wptrs = [w.data_ptr() for w in self._weights]
        self._gptrs = [g.data_ptr() for g in self._grads]

    @torch.no_grad()
    def _relink(self) -> None:
        """Copy in any weight or gradient that something replaced, and make it a view again."""
        if [p.data_ptr() for p in self.members] != self._wptrs:
            for p, w in zip(self.members, self._weights):
                if p.data_ptr() != w.data_ptr():
                    w.copy_(p)
                    p.data = w
        if [0 if p.grad is None else p.grad.data_ptr() for p in self.members] != self._gptrs:
            for p, g in zip(self.members, self._grads):
                if p.grad is None:
                    g.zero_()
                elif p.grad.data_ptr() != g.data_ptr():
                    g.copy_(p.grad)
                p.grad = g

    @torch.no_grad()
    def step(self, closure=None):
        self._relink()
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.flat.grad.zero_()
        self._relink()

    def state_dict(self) -> dict:
        sd = super().state_dict()
        flat_state, n = sd["state"].get(0, {}), self.flat.numel()
        sizes = [p.numel() for p in self.members]
        state = {i: {} for i in range(len(self.members))} if flat_state else {}
        for key, v in flat_state.items():
            if torch.is_tensor(v) and v.numel() == n:                    # a moment: one slice each
                for i, (part, p) in enumerate(zip(v.split(sizes), self.members)):
                    state[i][key] = part.view_as(p).clone()
            else:                                                        # the step count: a copy each
                for i in state:
                    state[i][key] = v.clone() if torch.is_tensor(v) else v
        (group,) = sd["param_groups"]
        return {"state": state, "param_groups": [{**group, "params": list(range(len(self.members)))}]}

    def load_state_dict(self, state_dict: dict) -> None:
        groups, state = state_dict["param_groups"], state_dict["state"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.members):
            raise ValueError(f"the saved optimizer holds {sum(len(g['params']) for g in groups)} parameters in "
                             f"{len(groups)} groups; this one {len(self.members)} in one (a different model?)")
        flat_state = {}
        if state:
            entries = [state.get(i, state.get(str(i))) for i in groups[0]["params"]]
            if any(e is None for e in entries):
                raise ValueError("the saved optimizer has state for some parameters only")
            for key, v in entries[0].items():
                if torch.is_tensor(v) and v.dim() > 0:                   # a moment: concatenated
                    for i, (e, p) in enumerate(zip(entries, self.members)):
                        if e[key].numel() != p.numel():
                            raise ValueError(f"the saved optimizer's {key} of parameter {i} has {e[key].numel()} "
                                             f"elements; the parameter has {p.numel()} (a different model?)")
                    flat_state[key] = torch.cat([e[key].reshape(-1) for e in entries])
                else:
                    flat_state[key] = v
        super().load_state_dict({"state": {0: flat_state} if flat_state else {},
                                 "param_groups": [{**groups[0], "params": [0]}]})
