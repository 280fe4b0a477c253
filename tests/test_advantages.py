"""Tests for rlvr.advantages: worked examples, a loop oracle, properties, errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlvr.advantages import (
    EPS,
    SCHEMES,
    agreeing_groups,
    compute,
    kl_reward_delta,
    nonzero_fraction,
    overlong_penalty,
    pad_steps,
    per_step_centered,
    process_delta,
    return_to_go,
    step_mismatch,
    token_steps,
)

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
    # the group probe: 0/1 reward, centering turns wrong answers into usable pushes
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
    """Four-answer policy (docs/background.md): over all G-sample draws, E[Δ_i ∇logπ(a_i)] is (G-1)/G × the true gradient for the
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


_Z = torch.zeros(2, 3)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: overlong_penalty(torch.tensor([3]), 10, 0), "buffer"),
        (lambda: overlong_penalty(torch.tensor([3]), 10, 11), "buffer"),
        (lambda: overlong_penalty(torch.tensor([3]), 10.0, 2), "max_len"),
        (lambda: overlong_penalty(torch.tensor([3]), 10, 2, penalty=0.0), "penalty"),
        (lambda: overlong_penalty(torch.tensor([-1]), 10, 2), "lengths"),
        (lambda: overlong_penalty(torch.tensor([1.5]), 10, 2), "lengths"),
        (lambda: kl_reward_delta(torch.zeros(2), torch.zeros(6), torch.zeros(6), torch.ones(6), 0.1), "logp_old"),
        (lambda: kl_reward_delta(torch.zeros(2), _Z, torch.zeros(2, 4), torch.ones(2, 3), 0.1), "logp_ref"),
        (lambda: kl_reward_delta(torch.zeros(2), _Z, _Z, torch.ones(3, 3), 0.1), "mask"),
        (lambda: kl_reward_delta(torch.zeros(3), _Z, _Z, torch.ones(2, 3), 0.1), "delta"),
        (lambda: kl_reward_delta(torch.zeros(2), _Z, _Z, torch.ones(2, 3), -0.1), "kl_coef"),
    ],
)
def test_shaping_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- reward shaping and per-token Δ: overlong penalty, KL in the reward ------------------------


def test_overlong_penalty_by_hand():
    # max_len 20, buffer 4: free up to 16 tokens, then -1/4 per token, -1 at 20
    lengths = torch.tensor([[10, 16, 17], [18, 20, 0]])
    want = torch.tensor([[0.0, 0.0, -0.25], [-0.5, -1.0, 0.0]])
    assert torch.equal(overlong_penalty(lengths, 20, 4), want)
    assert torch.equal(overlong_penalty(lengths, 20, 4, penalty=2.0), 2 * want)
    # buffer = max_len: the ramp starts at length 0
    assert overlong_penalty(torch.tensor([5]), 10, 10).item() == pytest.approx(-0.5)
    # beyond max_len (not produced by the sampler) it stays at -penalty
    assert overlong_penalty(torch.tensor([25]), 20, 4).item() == -1.0


def test_overlong_penalty_matches_verl_reward_manager():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 65, (6, 5), generator=g)
    max_len, buf, factor = 64, 16, 0.7
    want = [[min(-(L - (max_len - buf)) / buf * factor, 0) for L in row] for row in lengths.tolist()]
    assert torch.allclose(overlong_penalty(lengths, max_len, buf, factor), torch.tensor(want))


def test_kl_reward_delta_by_hand():
    # k1 = logp_old - logp_ref = 0.1, 0.2 on the two generated tokens (0.3 is padding)
    logp_old = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    logp_ref = torch.tensor([[-1.1, -1.2, -1.3], [-0.5, -0.7, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    delta = torch.tensor([1.0, -1.0], dtype=torch.float64)
    # return to go: row 0 [0.1 + 0.2, 0.2, -], row 1 [0 + 0.2 + 0, 0.2, 0]; β = 0.5
    got = kl_reward_delta(delta, logp_old, logp_ref, mask, 0.5)
    want = torch.tensor([[1 - 0.15, 1 - 0.1, 0.0], [-1 - 0.1, -1 - 0.1, -1.0]], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    # per token only
    got = kl_reward_delta(delta, logp_old, logp_ref, mask, 0.5, return_to_go=False)
    want = torch.tensor([[1 - 0.05, 1 - 0.1, 0.0], [-1.0, -1 - 0.1, -1.0]], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    # a (B, T) Δ (process rewards) takes the same penalty; β = 0 returns Δ masked
    per_tok = torch.arange(6, dtype=torch.float64).view(2, 3)
    assert torch.equal(kl_reward_delta(per_tok, logp_old, logp_ref, mask, 0.0), per_tok * mask)
    # padding with -inf never reaches the result
    inf_old = logp_old.clone()
    inf_old[0, 2] = -float("inf")
    assert torch.isfinite(kl_reward_delta(delta, inf_old, logp_ref, mask, 0.5)).all()


def verl_reinforce_pp_returns(scores, kl, mask, beta):
    """verl: apply_kl_penalty (token_level_scores - β·kl) then compute_reinforce_plus_plus_outcome_advantage's
    returns loop (γ = 1, reset after eos), before its whitening. The score sits on the last valid token."""
    B, T = len(mask), len(mask[0])
    rewards = [[0.0] * T for _ in range(B)]
    for b in range(B):
        last = max(t for t in range(T) if mask[b][t])
        rewards[b][last] = scores[b]
        for t in range(T):
            rewards[b][t] -= beta * kl[b][t] * mask[b][t]
    returns = [[0.0] * T for _ in range(B)]
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            running = rewards[b][t] + running
            returns[b][t] = running
            running = running * mask[b][t]
    return returns


def test_kl_reward_delta_matches_verl_reinforce_pp_returns():
    g = torch.Generator().manual_seed(3)
    B, T = 6, 7
    logp_old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    logp_ref = logp_old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    scores = torch.randn(B, generator=g, dtype=torch.float64)
    got = kl_reward_delta(scores, logp_old, logp_ref, mask, 0.05)
    kl = (logp_old - logp_ref).tolist()
    want = torch.tensor(verl_reinforce_pp_returns(scores.tolist(), kl, mask.tolist(), 0.05), dtype=torch.float64)
    assert torch.allclose(got, want * mask, rtol=1e-12, atol=1e-12)


def verl_reinforce_pp_baseline(scores, index, mask):
    """verl compute_reinforce_plus_plus_baseline_outcome_advantage (β = 0): group mean (0 for a group
    of one), broadcast over the response, masked_whiten over all generated tokens (Bessel N/(N-1))."""
    B, T = len(mask), len(mask[0])
    groups = {}
    for i in range(B):
        groups.setdefault(index[i], []).append(scores[i])
    c = [scores[i] - (sum(groups[index[i]]) / len(groups[index[i]]) if len(groups[index[i]]) > 1 else 0.0)
         for i in range(B)]
    vals = [c[b] for b in range(B) for t in range(T) if mask[b][t]]
    n = len(vals)
    mean = sum(vals) / (n + 1e-8)
    var = sum((v - mean) ** 2 for v in vals) / (n + 1e-8) * n / (n - 1)
    return [[(c[b] - mean) / math.sqrt(var + 1e-8) * mask[b][t] for t in range(T)] for b in range(B)]


def test_reinforce_pp_baseline_combination_against_verl():
    """scheme batch_normalized + kl_in reward at β = 0, equal lengths: verl whitens over the B·T
    tokens, rlvr over the B responses; the two differ exactly by the documented Bessel factor."""
    g = torch.Generator().manual_seed(5)
    P, G, T = 4, 3, 5
    rewards = torch.randint(0, 3, (P, G), generator=g).to(torch.float64)
    mask = torch.ones(P * G, T, dtype=torch.long)
    logp = -torch.rand(P * G, T, generator=g, dtype=torch.float64)
    rows = compute(rewards, "batch_normalized").reshape(-1)
    ours = kl_reward_delta(rows, logp, logp, mask, 0.0)  # (B, T)
    want = torch.tensor(verl_reinforce_pp_baseline(rewards.reshape(-1).tolist(), [b // G for b in range(P * G)],
                                                   mask.tolist()), dtype=torch.float64)
    B = P * G
    std_rows = compute(rewards, "centered").std().item()
    var_tok = std_rows**2 * T * (B - 1) / (B * T - 1)
    assert torch.allclose(want, ours * (std_rows + EPS) / math.sqrt(var_tok + 1e-8), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_kl_in_reward_gives_the_reverse_kl_gradient_by_enumeration(seed):
    """Two tokens from a vocabulary of 3, tabular policy π(y1) π(y2|y1). Over all 9 sequences,
    E[Σ_t Δ_t ∇log π(y_t|y<t)] with Δ = kl_reward_delta(0, ...) equals ∇(-β KL(π||π_ref)) exactly
    with the return to go, and misses the later tokens' term without it."""
    import itertools

    g = torch.Generator().manual_seed(seed)
    th1 = torch.randn(3, generator=g, dtype=torch.float64).requires_grad_()
    th2 = torch.randn(3, 3, generator=g, dtype=torch.float64).requires_grad_()
    r1 = torch.log_softmax(torch.randn(3, generator=g, dtype=torch.float64), 0)
    r2 = torch.log_softmax(torch.randn(3, 3, generator=g, dtype=torch.float64), 1)
    beta = 0.3

    def logps(y1, y2):
        return torch.stack([torch.log_softmax(th1, 0)[y1], torch.log_softmax(th2, 1)[y1, y2]])  # (2,)

    kl = sum(logps(a, b).sum().exp() * (logps(a, b).sum() - r1[a] - r2[a, b])
             for a, b in itertools.product(range(3), repeat=2))
    exact = torch.autograd.grad(-beta * kl, (th1, th2))
    for rtg in (True, False):
        surrogate = 0.0
        for a, b in itertools.product(range(3), repeat=2):
            lp = logps(a, b)
            ref = torch.stack([r1[a], r2[a, b]])
            d = kl_reward_delta(torch.zeros(1, dtype=torch.float64), lp.detach()[None], ref[None],
                                torch.ones(1, 2), beta, return_to_go=rtg)[0]  # (2,)
            surrogate = surrogate + lp.sum().detach().exp() * (d * lp).sum()
        est = torch.autograd.grad(surrogate, (th1, th2))
        same = all(torch.allclose(e, x, atol=1e-12) for e, x in zip(est, exact))
        assert same == rtg, rtg


# --- process rewards: per-step scores -> per-token Δ ------------------------------------------


def test_token_steps_per_character_and_by_delimiter():
    # per character: token t is step t; a special token (no text) belongs to no step
    assert token_steps([["1", "2", "3"], ["1", "", "3"]], "", 4).tolist() == [[0, 1, 2, -1], [0, -1, 1, -1]]
    # a multi-character token takes the step of its first character
    assert token_steps([["12", "3"]], "", 2).tolist() == [[0, 2]]
    # delimiter: the token that ends a step stays in it; "a\nb\n" is two steps
    assert token_steps([["a", "\n", "b", "\n"]], "\n", 5).tolist() == [[0, 0, 1, 1, -1]]
    # a two-character delimiter split over tokens, and a token that holds one whole step and more
    texts = [["x", ";", ";", "y", "z;;w"]]
    assert token_steps(texts, ";;", 5).tolist() == [[0, 0, 0, 1, 1]]
    with pytest.raises(ValueError, match="token_texts"):
        token_steps([["a", "b", "c"]], "", 2)


def test_pad_steps_by_hand():
    scores, m = pad_steps([[1.0, 0.0], [1.0], [], [0.5, 0.5]], 2)
    assert scores.shape == (2, 2, 2)
    assert scores.tolist() == [[[1.0, 0.0], [1.0, 0.0]], [[0.0, 0.0], [0.5, 0.5]]]
    assert m.tolist() == [[[True, True], [True, False]], [[False, False], [True, True]]]
    with pytest.raises(ValueError, match="group_size"):
        pad_steps([[1.0]] * 3, 2)


def test_per_step_centered_and_return_to_go_by_hand():
    # one prompt, G = 2, three one-token steps: x = [1, 0, 0] and [0, 1, 0]
    scores = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
    m = torch.ones(1, 2, 3, dtype=torch.bool)
    steps = torch.tensor([[0, 1, 2], [0, 1, 2]])
    # per step: step means 0.5, 0.5, 0 -> [0.5, -0.5, 0] and [-0.5, 0.5, 0]
    assert per_step_centered(scores, m, steps).tolist() == [[0.5, -0.5, 0.0], [-0.5, 0.5, 0.0]]
    # return to go: [1, 0, 0] and [1, 1, 0]; means 1, 0.5, 0 -> [0, -0.5, 0] and [0, 0.5, 0]:
    # the first token of each is worth the same total, so neither is pushed
    assert return_to_go(scores, m, steps).tolist() == [[0.0, -0.5, 0.0], [0.0, 0.5, 0.0]]


def test_process_delta_broadcasts_over_steps_and_handles_missing_steps():
    # G = 3; step 1 only in responses 0 and 1; response 2's reward failed (no steps)
    scores, m = pad_steps([[1.0, 1.0], [0.0, 0.0], []], 3)
    # tokens: row 0 = steps 0 0 1 (pad), row 1 = steps 0 1 1 1, row 2 = steps 0 0 0 0
    steps = torch.tensor([[0, 0, 1, -1], [0, 1, 1, 1], [0, 0, 0, 0]])
    got = process_delta(scores, m, steps, "per_step_centered")
    # step 0: mean of 1 and 0 = 0.5; step 1: mean 0.5; row 2 has no scored step -> 0
    assert got.tolist() == [[0.5, 0.5, 0.5, 0.0], [-0.5, -0.5, -0.5, -0.5], [0.0, 0.0, 0.0, 0.0]]
    got = process_delta(scores, m, steps, "return_to_go")  # to go: [2, 1] and [0, 0]; means 1, 0.5
    assert got.tolist() == [[1.0, 1.0, 0.5, 0.0], [-1.0, -0.5, -0.5, -0.5], [0.0, 0.0, 0.0, 0.0]]
    assert step_mismatch(m, steps).tolist() == [False, False, True]
    # a token of a step beyond the scores gets 0 and flags the row
    steps2 = torch.tensor([[0, 1, 2, 2], [0, 1, 1, 1], [-1, -1, -1, -1]])
    got = process_delta(scores, m, steps2, "per_step_centered")
    assert got[0].tolist() == [0.5, 0.5, 0.0, 0.0]
    assert step_mismatch(m, steps2).tolist() == [True, False, False]


def test_process_delta_agreeing_steps_and_group_of_one_give_exact_zero():
    scores, m = pad_steps([[0.3, 1.0], [0.3, 0.0]], 2)
    got = process_delta(scores, m, torch.tensor([[0, 1], [0, 1]]), "per_step_centered")
    assert got[:, 0].tolist() == [0.0, 0.0] and got[:, 1].tolist() == [0.5, -0.5]
    scores, m = pad_steps([[1.0, 0.0]], 1)
    for mode in ("per_step_centered", "return_to_go"):
        assert torch.equal(process_delta(scores, m, torch.tensor([[0, 1]]), mode), torch.zeros(1, 2))


def _loop_process_delta(steps, G, token_step, mode):
    """Plain-Python oracle: per step index, centre over the group's responses that have the step."""
    B = len(steps)
    vals = [list(s) for s in steps]
    if mode == "return_to_go":
        vals = [[sum(s[i:]) for i in range(len(s))] for s in steps]
    out = [[0.0] * len(token_step[0]) for _ in range(B)]
    for b in range(B):
        group = range(b // G * G, b // G * G + G)
        for t, s in enumerate(token_step[b]):
            if s < 0 or s >= len(vals[b]):
                continue
            have = [vals[o][s] for o in group if s < len(vals[o])]
            if max(have) != min(have):
                out[b][t] = vals[b][s] - sum(have) / len(have)
    return out


@settings(max_examples=40, deadline=None)
@given(data=st.data(), P=st.integers(1, 3), G=st.integers(1, 4), mode=st.sampled_from(["per_step_centered", "return_to_go"]))
def test_process_delta_matches_a_loop(data, P, G, mode):
    steps = [data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), max_size=4)) for _ in range(P * G)]
    T = 5
    token_step = [data.draw(st.lists(st.integers(-1, 4), min_size=T, max_size=T)) for _ in range(P * G)]
    scores, m = pad_steps(steps, G)
    got = process_delta(scores, m, torch.tensor(token_step), mode)
    want = _loop_process_delta(steps, G, token_step, mode)
    assert torch.allclose(got, torch.tensor(want, dtype=got.dtype), atol=1e-12)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: process_delta(torch.zeros(1, 2, 3), torch.ones(1, 2, 3, dtype=torch.bool), torch.zeros(2, 3, dtype=torch.long), "sum"), "process_delta.*per_step_centered.*return_to_go"),
        (lambda: process_delta(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, 3, dtype=torch.long), "return_to_go"), "step_scores"),
        (lambda: process_delta(torch.zeros(1, 2, 3), torch.ones(1, 2, 3), torch.zeros(2, 3, dtype=torch.long), "return_to_go"), "step_mask"),
        (lambda: process_delta(torch.zeros(1, 2, 3), torch.ones(1, 2, 3, dtype=torch.bool), torch.zeros(3, 3, dtype=torch.long), "return_to_go"), "token_step"),
        (lambda: process_delta(torch.zeros(1, 2, 3), torch.ones(1, 2, 3, dtype=torch.bool), torch.zeros(2, 3), "return_to_go"), "token_step"),
        (lambda: process_delta(torch.full((1, 2, 3), math.nan), torch.ones(1, 2, 3, dtype=torch.bool), torch.zeros(2, 3, dtype=torch.long), "return_to_go"), "step_scores"),
        (lambda: token_steps([["a"]], None, 2), "delimiter"),
    ],
)
def test_process_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
