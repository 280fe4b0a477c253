"""Tests for rlvr.advantages: worked examples, a loop oracle, properties, errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlvr.advantages import EPS, SCHEMES, agreeing_groups, compute, nonzero_fraction

NO_BASELINE = [s for s in SCHEMES if s != "baseline"]


# --- tier 1: exact, worked by hand -----------------------------------------------------------


def test_seed002_group_of_8_with_2_correct():
    rewards = torch.tensor([[0, 0, 1, 1, 0, 0, 0, 0]], dtype=torch.float64)
    delta = compute(rewards, "centered")
    expected = torch.tensor([[-0.25, -0.25, 0.75, 0.75, -0.25, -0.25, -0.25, -0.25]], dtype=torch.float64)
    assert torch.equal(delta, expected)  # baseline 2/8 = 0.25 is exact in binary
    # 8 of 8 correct: baseline 1, every Δ is 0
    assert torch.equal(compute(torch.ones(1, 8), "centered"), torch.zeros(1, 8))


def test_seed000_two_states_two_actions_baseline():
    rewards = torch.tensor([[11.0, 9.0], [0.0, 2.0]])  # rows S1, S2; columns A1, A2
    delta = compute(rewards, "baseline", baseline=[10.0, 1.0])
    assert torch.equal(delta, torch.tensor([[1.0, -1.0], [-1.0, 1.0]]))
    # the group mean is that same baseline here
    assert torch.equal(compute(rewards, "centered"), delta)
    assert torch.equal(compute(rewards, "raw"), rewards)


def test_loo_by_hand():
    delta = compute(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), "loo")
    # sample 0: 1 - 0 = 1; the others: 0 - (1 + 0 + 0)/3 = -1/3
    assert torch.allclose(delta, torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]]))
    delta = compute(torch.tensor([[3.0, 1.0]]), "loo")
    assert torch.equal(delta, torch.tensor([[2.0, -2.0]]))


def test_normalized_by_hand_unbiased_std():
    # [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    delta = compute(torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64), "normalized")
    expected = torch.tensor([[0.75, -0.25, -0.25, -0.25]], dtype=torch.float64) / (0.5 + EPS)
    assert torch.allclose(delta, expected, rtol=0, atol=1e-12)


def test_batch_normalized_by_hand():
    # centered values: [0.5, -0.5] and [0, 0] (agreeing group); unbiased std over 4 values
    rewards = torch.tensor([[1.0, 0.0], [2.0, 2.0]], dtype=torch.float64)
    std = math.sqrt((0.25 + 0.25) / 3)
    expected = torch.tensor([[0.5, -0.5], [0.0, 0.0]], dtype=torch.float64) / (std + EPS)
    assert torch.allclose(compute(rewards, "batch_normalized"), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("scheme", ["centered", "normalized", "loo", "batch_normalized"])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.3, 0.1, -7.7, 1e6 + 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_agreeing_groups_give_exact_zeros(scheme, value, dtype):
    for G in (1, 3, 7, 8) if scheme != "loo" else (3, 7, 8):
        rewards = torch.full((2, G), value, dtype=dtype)
        delta = compute(rewards, scheme)
        assert torch.equal(delta, torch.zeros_like(delta)), (scheme, value, G, delta)
        assert not torch.isnan(delta).any()


def test_agreeing_group_zero_next_to_a_learning_group():
    rewards = torch.tensor([[0.3, 0.3, 0.3], [1.0, 0.0, 0.0]])
    for scheme in ("centered", "normalized", "loo", "batch_normalized"):
        delta = compute(rewards, scheme)
        assert torch.equal(delta[0], torch.zeros(3)), scheme
        assert (delta[1] != 0).all(), scheme


def test_top_k_worked_example_and_ties_kept():
    rewards = torch.tensor([[0.0, 3.0, 1.0, 2.0], [1.0, 1.0, 0.0, 0.0]])
    delta = compute(rewards, "raw", top_k=2)
    assert torch.equal(delta, torch.tensor([[0.0, 3.0, 0.0, 2.0], [1.0, 1.0, 0.0, 0.0]]))
    # ties: top_k=1 keeps BOTH responses tied at the top reward, in any order
    delta = compute(torch.tensor([[1.0, 0.0, 1.0, 0.5]]), "centered", top_k=1)
    assert torch.equal(delta, torch.tensor([[0.375, 0.0, 0.375, 0.0]]))
    # a tie at the k-th place keeps every tied response: top_k=2 on [3, 2, 2, 1] keeps 3 of them
    delta = compute(torch.tensor([[3.0, 2.0, 2.0, 1.0]]), "raw", top_k=2)
    assert torch.equal(delta, torch.tensor([[3.0, 2.0, 2.0, 0.0]]))
    # top_k = G keeps everything
    r = torch.tensor([[0.2, 0.9, 0.4]])
    assert torch.equal(compute(r, "normalized", top_k=3), compute(r, "normalized"))


def test_int_and_list_rewards_become_float():
    delta = compute([[1, 0], [0, 0]], "centered")
    assert delta.dtype == torch.get_default_dtype()
    assert torch.equal(delta, torch.tensor([[0.5, -0.5], [0.0, 0.0]]))
    assert compute(torch.tensor([[True, False]]), "raw").is_floating_point()
    assert compute(torch.zeros(1, 2, dtype=torch.float64), "raw").dtype == torch.float64


def test_compute_does_not_modify_rewards():
    rewards = torch.tensor([[1.0, 0.0, 2.0]])
    before = rewards.clone()
    for scheme in NO_BASELINE:
        compute(rewards, scheme, top_k=1)
    assert torch.equal(rewards, before)


def test_diagnostics():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.3, 0.3, 0.3]])
    assert agreeing_groups(rewards).tolist() == [True, False, True]
    raw = compute(rewards, "raw")
    assert nonzero_fraction(raw) == pytest.approx(7 / 9)
    assert nonzero_fraction(compute(rewards, "centered")) == pytest.approx(3 / 9)
    assert nonzero_fraction(torch.zeros(0, 3)) == 0.0
    # seed 000's builder test: 0/1 reward, centering turns wrong answers into usable pushes
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert nonzero_fraction(compute(r, "raw")) == 0.25
    assert nonzero_fraction(compute(r, "centered")) == 1.0


# --- tier 2: a plain-loop oracle -------------------------------------------------------------


def _mean(xs):
    return sum(xs) / len(xs)


def _std_unbiased(xs):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def oracle(rewards, scheme, baseline=None, top_k=None):
    """The obvious loops, one group at a time, in python floats."""
    out = []
    for p, group in enumerate(rewards):
        G = len(group)
        agree = max(group) == min(group)
        if scheme == "raw":
            d = list(group)
        elif scheme == "baseline":
            d = [r - baseline[p] for r in group]
        elif agree:
            d = [0.0] * G
        elif scheme == "centered" or scheme == "batch_normalized":
            d = [r - _mean(group) for r in group]
        elif scheme == "normalized":
            d = [(r - _mean(group)) / (_std_unbiased(group) + EPS) for r in group]
        elif scheme == "loo":
            d = [group[i] - sum(group[j] for j in range(G) if j != i) / (G - 1) for i in range(G)]
        out.append(d)
    if scheme == "batch_normalized":
        flat = [x for row in out for x in row]
        if any(x != 0 for x in flat):
            s = _std_unbiased(flat)
            out = [[x / (s + EPS) for x in row] for row in out]
    if top_k is not None:
        for p, group in enumerate(rewards):
            kth = sorted(group, reverse=True)[top_k - 1]
            out[p] = [d if r >= kth else 0.0 for d, r in zip(out[p], group)]
    return out


# small integer-valued rewards so groups often agree or tie; a few distinct levels
reward_matrices = st.integers(1, 5).flatmap(
    lambda P: st.integers(2, 6).flatmap(
        lambda G: st.lists(
            st.lists(st.sampled_from([0.0, 0.5, 1.0, 0.3, 2.0, -1.0]), min_size=G, max_size=G),
            min_size=P,
            max_size=P,
        )
    )
)


@settings(max_examples=60, deadline=None)
@given(rewards=reward_matrices, scheme=st.sampled_from(list(SCHEMES)), data=st.data())
def test_oracle_every_scheme_and_top_k(rewards, scheme, data):
    P, G = len(rewards), len(rewards[0])
    baseline = data.draw(st.lists(st.floats(-2, 2), min_size=P, max_size=P)) if scheme == "baseline" else None
    top_k = data.draw(st.none() | st.integers(1, G))
    got = compute(torch.tensor(rewards, dtype=torch.float64), scheme, baseline=baseline, top_k=top_k)
    want = torch.tensor(oracle(rewards, scheme, baseline, top_k), dtype=torch.float64)
    assert got.shape == (P, G)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-9), (got, want)


@pytest.mark.parametrize("seed", range(3))
def test_oracle_random_continuous_float32(seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(7, 5, generator=g)
    for scheme in NO_BASELINE:
        got = compute(rewards, scheme, top_k=3)
        want = torch.tensor(oracle(rewards.double().tolist(), scheme, top_k=3))
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), scheme


# --- tier 3: properties ----------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(P=st.integers(1, 4), G=st.integers(2, 8), seed=st.integers(0, 10_000))
def test_properties(P, G, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (P, G), generator=g).double()
    cen = compute(rewards, "centered")
    # centered Δ sums to zero in every group
    assert torch.allclose(cen.sum(dim=1), torch.zeros(P, dtype=torch.float64), atol=1e-12)
    # loo = G/(G-1) * centered
    assert torch.allclose(compute(rewards, "loo"), cen * G / (G - 1), atol=1e-12)
    # normalized Δ is invariant to a positive scale and a shift (up to EPS)
    scale = 0.5 + 10 * torch.rand((), generator=g).item()
    shift = 5 * torch.randn((), generator=g).item()
    a = compute(rewards, "normalized")
    b = compute(rewards * scale + shift, "normalized")
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    # normalized non-agreeing groups have unit unbiased std (up to EPS)
    moving = ~agreeing_groups(rewards)
    if moving.any():
        assert torch.allclose(a[moving].std(dim=1), torch.ones(int(moving.sum()), dtype=torch.float64), rtol=1e-5)
    # batch_normalized is the centered Δ up to one positive factor for the whole batch
    bn = compute(rewards, "batch_normalized")
    if cen.abs().sum() > 0:
        factor = (bn[cen != 0] / cen[cen != 0])
        assert torch.allclose(factor, factor[0].expand_as(factor)) and factor[0] > 0
    # nothing produces a NaN
    for scheme in NO_BASELINE:
        assert torch.isfinite(compute(rewards, scheme)).all()


def test_centered_and_loo_expected_gradient_by_enumeration():
    """Seed 001: over all G-sample draws, E[Δ_i ∇logπ(a_i)] is (G-1)/G × the true gradient for the
    inclusive mean and exactly the true gradient for leave-one-out."""
    import itertools

    theta = torch.tensor([0.3, -0.2, 0.5, 0.0], dtype=torch.float64, requires_grad=True)
    reward_of = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    probs = torch.softmax(theta, 0)
    (true_grad,) = torch.autograd.grad((probs * reward_of).sum(), theta)
    G = 3
    expected = {"centered": torch.zeros(4, dtype=torch.float64), "loo": torch.zeros(4, dtype=torch.float64)}
    for draw in itertools.product(range(4), repeat=G):
        weight = math.prod(probs[a].item() for a in draw)
        rewards = reward_of[list(draw)][None, :]  # (1, G)
        for scheme in expected:
            delta = compute(rewards, scheme)[0]
            logp = torch.log_softmax(theta, 0)[list(draw)]
            (grad,) = torch.autograd.grad((delta * logp).sum() / G, theta)
            expected[scheme] += weight * grad
    assert torch.allclose(expected["loo"], true_grad, atol=1e-12)
    assert torch.allclose(expected["centered"], true_grad * (G - 1) / G, atol=1e-12)


# --- tier 4: errors name the argument --------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rewards=torch.zeros(4), scheme="raw"), "rewards"),
        (dict(rewards=torch.zeros(2, 2, 2), scheme="raw"), "rewards"),
        (dict(rewards=torch.zeros(0, 3), scheme="raw"), "rewards"),
        (dict(rewards=torch.tensor([[0.0, float("nan")]]), scheme="centered"), "rewards"),
        (dict(rewards=torch.tensor([[0.0, float("inf")]]), scheme="raw"), "rewards"),
        (dict(rewards=torch.tensor([[0.0, -float("inf")]]), scheme="normalized"), "rewards"),
        (dict(rewards=torch.zeros(2, 3), scheme="grpo"), "scheme.*raw.*baseline.*centered.*normalized.*loo"),
        (dict(rewards=torch.zeros(2, 1), scheme="loo"), "loo.*G"),
        (dict(rewards=torch.zeros(2, 3), scheme="raw", top_k=0), "top_k"),
        (dict(rewards=torch.zeros(2, 3), scheme="raw", top_k=4), "top_k"),
        (dict(rewards=torch.zeros(2, 3), scheme="raw", top_k=-1), "top_k"),
        (dict(rewards=torch.zeros(2, 3), scheme="raw", top_k=1.5), "top_k"),
        (dict(rewards=torch.zeros(2, 3), scheme="raw", top_k=True), "top_k"),
        (dict(rewards=torch.zeros(2, 3), scheme="baseline"), "baseline"),
        (dict(rewards=torch.zeros(2, 3), scheme="baseline", baseline=[1.0]), "baseline"),
        (dict(rewards=torch.zeros(2, 3), scheme="baseline", baseline=torch.zeros(2, 1)), "baseline"),
        (dict(rewards=torch.zeros(2, 3), scheme="baseline", baseline=[0.0, float("nan")]), "baseline"),
        (dict(rewards=torch.zeros(2, 3), scheme="centered", baseline=[0.0, 0.0]), "baseline"),
    ],
)
def test_errors_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute(**kwargs)
