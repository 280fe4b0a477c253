"""rlvr.optim.FlatAdamW: torch's fused AdamW over the list, bit for bit, at a fraction of the calls."""

import pytest
import torch

from rlvr import config as config_mod
from rlvr.learn import make_optimizer
from rlvr.optim import FLAT_ALIGN, FlatAdamW, flat_fits

LORA_SHAPES = [(16, 576), (576, 16), (16, 576), (192, 16)] * 3    # SmolLM2's q/v adapters, 3 layers
KW = dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)


class Adapters(torch.nn.Module):
    """Parameters of the given shapes and a loss that reaches each of them differently."""

    def __init__(self, shapes, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes)

    def loss(self, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return sum(((p - torch.randn(p.shape, generator=g)) ** 2 * (i + 1)).sum() for i, p in enumerate(self.ps))


def train(model: Adapters, opt, steps: int, start: int = 0, accumulate: int = 1) -> None:
    for s in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        for a in range(accumulate):                          # gradients add up over backwards
            model.loss(100 * s + a).backward()
        opt.param_groups[0]["lr"] = KW["lr"] * (1 + s % 3)  # as a schedule would
        opt.step()


@pytest.mark.parametrize("threads", [1, 2])
def test_flat_adamw_is_torch_fused_adamw_bit_for_bit(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = Adapters(LORA_SHAPES), Adapters(LORA_SHAPES)
        ref, flat = torch.optim.AdamW(list(a.ps), fused=True, **KW), FlatAdamW(list(b.ps), **KW)
        train(a, ref, 6, accumulate=2)
        train(b, flat, 6, accumulate=2)
    finally:
        torch.set_num_threads(old)
    for pa, pb in zip(a.ps, b.ps):
        assert torch.equal(pa, pb)
        assert torch.equal(pa.grad, pb.grad)
    sa, sb = ref.state_dict(), flat.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


def test_one_kernel_call_over_one_tensor():
    m = Adapters(LORA_SHAPES)
    opt = FlatAdamW(list(m.ps), **KW)
    train(m, opt, 2)
    assert [len(g["params"]) for g in opt.param_groups] == [1]
    assert opt.flat.numel() == sum(p.numel() for p in m.ps)
    assert all(p.grad.data_ptr() == g.data_ptr() for p, g in zip(m.ps, opt._grads))   # gradients are views


@pytest.mark.parametrize("direction", ["flat->torch", "torch->flat"])
def test_state_dicts_load_into_either(direction):
    """A run saved with one optimizer resumes with the other and continues on the same numbers."""
    first, then = (FlatAdamW, None) if direction == "flat->torch" else (None, FlatAdamW)

    def build(kind, model):
        return kind(list(model.ps), **KW) if kind else torch.optim.AdamW(list(model.ps), fused=True, **KW)

    straight = Adapters(LORA_SHAPES)
    opt = build(None, straight)
    train(straight, opt, 5)
    m1 = Adapters(LORA_SHAPES)
    o1 = build(first, m1)
    train(m1, o1, 3)
    m2 = Adapters(LORA_SHAPES)
    m2.load_state_dict(m1.state_dict())
    o2 = build(then, m2)
    o2.load_state_dict(o1.state_dict())
    train(m2, o2, 2, start=3)
    for p, q in zip(straight.ps, m2.ps):
        assert torch.equal(p, q)


def pair():
    """Two copies of the adapters: one under torch's fused AdamW, one under FlatAdamW."""
    a, b = Adapters(LORA_SHAPES), Adapters(LORA_SHAPES)
    return (a, torch.optim.AdamW(list(a.ps), fused=True, **KW)), (b, FlatAdamW(list(b.ps), **KW))


def assert_same(a: Adapters, b: Adapters) -> None:
    for pa, pb in zip(a.ps, b.ps):
        assert torch.equal(pa, pb)


def test_weights_written_between_steps_are_used():
    """A state load (an in-place write) or a replaced .data between steps: the next step starts from it."""
    (a, ref), (b, flat) = pair()
    new = Adapters(LORA_SHAPES, seed=7)
    for m, opt in ((a, ref), (b, flat)):
        train(m, opt, 2)
        m.load_state_dict(new.state_dict())
        train(m, opt, 2, start=2)
        m.ps[1].data = new.ps[1].detach().clone() * 2
        train(m, opt, 1, start=4)
    assert_same(a, b)
    assert b.ps[1].data_ptr() == flat._weights[1].data_ptr()                  # a view of the flat buffer again


def test_replaced_gradients_are_used():
    """module.zero_grad(set_to_none=True) or a .grad assigned by hand: the next step still sees them."""
    (a, ref), (b, flat) = pair()
    for m, opt in ((a, ref), (b, flat)):
        m.zero_grad(set_to_none=True)
        m.loss(1).backward()
        m.ps[0].grad = torch.full_like(m.ps[0], 0.5)
        opt.step()
    assert_same(a, b)
    assert all(p.grad.data_ptr() == g.data_ptr() for p, g in zip(b.ps, flat._grads))


def test_flat_fits_only_where_bit_for_bit_holds():
    ok = [torch.nn.Parameter(torch.zeros(s)) for s in LORA_SHAPES]
    assert flat_fits(ok)
    assert not flat_fits(ok[:1])                                                         # one tensor: nothing to gain
    assert not flat_fits(ok + ok[:1])                                                    # a parameter twice
    assert not flat_fits(ok + [torch.nn.Parameter(torch.zeros(FLAT_ALIGN + 1))])         # a scalar tail
    assert not flat_fits([torch.nn.Parameter(p.detach().bfloat16()) for p in ok])
    assert not flat_fits(ok + [torch.nn.Parameter(torch.zeros(1 << 24))])                # over FLAT_MAX
    tc = config_mod.TrainConfig()
    assert type(make_optimizer(ok, tc)) is FlatAdamW
    odd = [torch.nn.Parameter(torch.zeros(15, 8)), torch.nn.Parameter(torch.zeros(8))]
    assert type(make_optimizer(odd, tc)) is torch.optim.AdamW


def test_load_refuses_another_models_state():
    m = Adapters(LORA_SHAPES)
    opt = FlatAdamW(list(m.ps), **KW)
    train(m, opt, 1)
    sd = opt.state_dict()
    other = FlatAdamW(list(Adapters(LORA_SHAPES[:-1]).ps), **KW)
    with pytest.raises(ValueError, match="11 in one"):
        other.load_state_dict(sd)
    swapped = Adapters(LORA_SHAPES[1:] + LORA_SHAPES[:1])
    with pytest.raises(ValueError, match="exp_avg of parameter 2 has 9216 elements; the parameter has 3072"):
        FlatAdamW(list(swapped.ps), **KW).load_state_dict(sd)


def test_a_torch_without_the_fused_kernel_gets_plain_adamw_and_untouched_parameters(monkeypatch):
    """The package allows torch versions whose AdamW has no fused CPU kernel: make_optimizer then
    falls back to the loop over tensors, and FlatAdamW has not rebound any parameter or gradient."""
    plain = torch.optim.AdamW.__init__

    def no_fused(self, params, *a, fused=None, **kw):
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        plain(self, params, *a, **kw)

    monkeypatch.setattr(torch.optim.AdamW, "__init__", no_fused)
    m = Adapters(LORA_SHAPES)
    ptrs = [p.data_ptr() for p in m.ps]
    opt = make_optimizer(list(m.ps), config_mod.TrainConfig())
    assert type(opt) is torch.optim.AdamW and not opt.defaults.get("fused")
    assert [p.data_ptr() for p in m.ps] == ptrs and all(p.grad is None for p in m.ps)
