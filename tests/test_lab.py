"""Tests for rlvr.lab: the four-answer policy and bandit figures exactly, plus loops in the test as oracles."""

from __future__ import annotations

import ast
import itertools
import math
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlvr import advantages, lab

P001 = (0.2, 0.3, 0.4, 0.1)
R001 = (1.0, 0.0, 0.0, 0.0)
TOL = 1e-9


def random_policy(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(n, generator=g, dtype=torch.float64) * 2, dim=0)
    rewards = torch.randn(n, generator=g, dtype=torch.float64)
    return probs, rewards


def assert_close(actual, expected, tol=TOL):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape
    assert torch.allclose(actual, expected, rtol=0, atol=tol), (actual.tolist(), expected.tolist())


# --- the four-answer policy ----------------------------------------------------------------------------------


def test_seed001_expected_reward_and_gradient():
    assert lab.expected_reward(P001, R001) == pytest.approx(0.2, abs=1e-12)
    grad = lab.exact_gradient(P001, R001)
    assert grad.dtype == torch.float64
    assert_close(grad, [0.16, -0.06, -0.08, -0.02], 1e-12)


def test_seed001_finite_differences_match():
    assert_close(lab.finite_difference_gradient(P001, R001), [0.16, -0.06, -0.08, -0.02], 1e-9)


def test_seed001_one_ascent_step():
    new = lab.gradient_step(P001, R001, 0.1)
    assert new[0].item() == pytest.approx(0.203624, abs=1e-6)
    assert new.sum().item() == pytest.approx(1.0, abs=1e-12)
    # The step moves along the gradient: mass leaves the unrewarded actions.
    assert all(new[i].item() < P001[i] for i in (1, 2, 3))


@pytest.mark.parametrize("baseline, variance", [(0.0, 0.1024), (0.2, 0.0576), (2.0, 0.2304)])
def test_seed001_variances_by_baseline(baseline, variance):
    mean, var = lab.estimator_moments(P001, R001, baseline)
    assert var[0].item() == pytest.approx(variance, abs=1e-12)
    assert_close(mean, lab.exact_gradient(P001, R001), 1e-12)


def test_seed001_pairs_centered_halves_and_loo_recovers():
    grad = lab.exact_gradient(P001, R001)
    cen, _ = lab.group_estimator_moments(P001, R001, 2, "centered")
    loo, _ = lab.group_estimator_moments(P001, R001, 2, "loo")
    assert_close(cen, [0.08, -0.03, -0.04, -0.01], 1e-12)
    assert_close(loo, grad, 1e-12)


# --- identities on random policies (oracles in the test) ----------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_finite_differences_agree_on_random_policies(seed):
    probs, rewards = random_policy(seed, 2 + seed)
    assert_close(lab.finite_difference_gradient(probs, rewards), lab.exact_gradient(probs, rewards), 1e-8)


def test_finite_differences_would_catch_a_wrong_gradient():
    # Guard on the check itself: the naive p_a R_a (no centering) disagrees with finite differences.
    probs, rewards = random_policy(11, 5)
    wrong = probs * rewards
    assert (lab.finite_difference_gradient(probs, rewards) - wrong).abs().max() > 1e-3


@settings(max_examples=40, deadline=None)
@given(
    logits=st.lists(st.floats(-4, 4), min_size=2, max_size=6),
    reward_seed=st.integers(0, 10_000),
    baseline=st.floats(-10, 10),
)
def test_baseline_leaves_expected_gradient_unchanged(logits, reward_seed, baseline):
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64), dim=0)
    rewards = torch.randn(len(logits), generator=torch.Generator().manual_seed(reward_seed), dtype=torch.float64)
    mean, var = lab.estimator_moments(probs, rewards, baseline)
    assert_close(mean, lab.exact_gradient(probs, rewards), 1e-10)
    assert bool((var >= -1e-12).all())


@pytest.mark.parametrize("seed", range(4))
def test_estimator_moments_match_a_plain_loop(seed):
    probs, rewards = random_policy(100 + seed, 4)
    b = 0.3 * seed - 0.5
    p, r = probs.tolist(), rewards.tolist()
    n = len(p)
    mean = [0.0] * n
    second = [0.0] * n
    for a in range(n):
        for j in range(n):
            x = (r[a] - b) * ((1.0 if j == a else 0.0) - p[j])
            mean[j] += p[a] * x
            second[j] += p[a] * x * x
    var = [second[j] - mean[j] ** 2 for j in range(n)]
    got_mean, got_var = lab.estimator_moments(probs, rewards, b)
    assert_close(got_mean, mean, 1e-12)
    assert_close(got_var, var, 1e-12)


@pytest.mark.parametrize("G", [2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_group_centered_is_scaled_and_loo_is_unbiased(G, seed):
    probs, rewards = random_policy(200 + seed, 3)
    grad = lab.exact_gradient(probs, rewards)
    cen, _ = lab.group_estimator_moments(probs, rewards, G, "centered")
    loo, _ = lab.group_estimator_moments(probs, rewards, G, "loo")
    raw, _ = lab.group_estimator_moments(probs, rewards, G, "raw")
    assert_close(cen, (G - 1) / G * grad, 1e-12)
    assert_close(loo, grad, 1e-12)
    assert_close(raw, grad, 1e-12)


def test_group_moments_match_a_plain_loop():
    # Oracle: enumerate every triple by hand with the inclusive mean written out in the loop.
    probs, rewards = random_policy(7, 3)
    p, r = probs.tolist(), rewards.tolist()
    G, n = 3, 3
    tuples = list(itertools.product(range(n), repeat=G))
    weights, estimates = [], []
    for acts in tuples:
        rs = [r[a] for a in acts]
        base = sum(rs) / G
        est = [0.0] * n
        for a, x in zip(acts, rs):
            for j in range(n):
                est[j] += (x - base) * ((1.0 if j == a else 0.0) - p[j]) / G
        weights.append(math.prod(p[a] for a in acts))
        estimates.append(est)
    mean = [sum(w * e[j] for w, e in zip(weights, estimates)) for j in range(n)]
    var = [sum(w * (e[j] - mean[j]) ** 2 for w, e in zip(weights, estimates)) for j in range(n)]
    got_mean, got_var = lab.group_estimator_moments(probs, rewards, G, "centered")
    assert_close(got_mean, mean, 1e-12)
    assert_close(got_var, var, 1e-12)


def test_group_baseline_scheme_recovers_gradient_and_group_of_one():
    probs, rewards = random_policy(3, 4)
    grad = lab.exact_gradient(probs, rewards)
    mean, _ = lab.group_estimator_moments(probs, rewards, 2, "baseline", baseline=0.7)
    assert_close(mean, grad, 1e-12)
    # G = 1 with the baseline scheme is the single-sample estimator.
    m1, v1 = lab.group_estimator_moments(probs, rewards, 1, "baseline", baseline=0.7)
    m2, v2 = lab.estimator_moments(probs, rewards, 0.7)
    assert_close(m1, m2, 1e-12)
    assert_close(v1, v2, 1e-12)


# --- the three-action bandit ------------------------------------------------------------------------


def listing(seed=0, lr=0.5, k=8, steps=200):
    """The bandit listing of docs/background.md, verbatim apart from the parameters (the oracle)."""
    random.seed(seed)
    logits = [0.0, 0.0, 0.0]

    def probs(l):
        m = max(l)
        e = [math.exp(x - m) for x in l]
        t = sum(e)
        return [v / t for v in e]

    for step in range(steps):
        p = probs(logits)
        acts = random.choices(range(3), weights=p, k=k)
        rewards = [1.0 if a == 2 else 0.0 for a in acts]
        base = sum(rewards) / len(rewards)
        for a, r in zip(acts, rewards):
            adv = r - base
            for j in range(3):
                grad = (1.0 if j == a else 0.0) - p[j]
                logits[j] += lr * adv * grad / len(acts)
    return probs(logits)


def test_seed002_bandit_output():
    assert [round(x, 3) for x in lab.bandit()] == [0.003, 0.003, 0.994]


@pytest.mark.parametrize("seed, lr, k, steps", [(0, 0.5, 8, 200), (1, 5.0, 8, 50), (3, 0.5, 4, 60), (7, 1.3, 16, 30)])
def test_bandit_matches_listing_bit_for_bit(seed, lr, k, steps):
    assert lab.bandit(seed=seed, lr=lr, group_size=k, steps=steps) == listing(seed, lr, k, steps)


def test_bandit_leaves_global_random_alone():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    lab.bandit(steps=5)
    assert random.random() == expected


def test_bandit_drives_delta_through_advantages(monkeypatch):
    calls = []
    real = advantages.compute

    def spy(rewards, scheme, **kw):
        calls.append(scheme)
        return real(rewards, scheme, **kw)

    lab._group_delta.cache_clear()
    monkeypatch.setattr(advantages, "compute", spy)
    try:
        lab.bandit(steps=3, scheme="loo")
    finally:
        lab._group_delta.cache_clear()
    assert calls and set(calls) == {"loo"}


def test_bandit_zero_steps_is_uniform():
    assert lab.bandit(steps=0, rewards=(0.0, 1.0, 0.0, 0.0)) == [0.25] * 4


def test_exercise_listing_setup_never_locks_wrong():
    # With one rewarded action and centered Δ, p(rewarded) cannot decrease (see module docstring).
    res = lab.bandit_exercise(seeds=10)
    assert set(res) == {5.0, 0.5}
    for f in res.values():
        assert f["locked_wrong"] == 0.0
        assert f["solved"] == 1.0
    assert res[5.0]["mean_p_best"] > res[0.5]["mean_p_best"]


def test_exercise_large_lr_locks_onto_wrong_action_more_often():
    res = lab.bandit_exercise(seeds=20, scheme="raw", rewards=(0.5, 0.5, 1.0), group_size=2)
    hi, lo = res[5.0], res[0.5]
    assert hi["locked_wrong"] > lo["locked_wrong"]
    assert hi["locked_wrong"] >= 0.1
    assert lo["locked_wrong"] == 0.0
    for f in (hi, lo):
        assert f["solved"] + f["locked_wrong"] + f["unsettled"] == pytest.approx(1.0)
    assert "lr 5" in lab.format_exercise(res)


# --- learned and optimal baselines ---------------------------------------------------------------


def test_optimal_baseline_and_total_variances_by_hand():
    # ‖onehot(a) - p‖² = 1 - 2 p_a + Σp² with Σp² = 0.3: 0.9, 0.7, 0.5, 1.1; E[‖g‖²] = 0.7,
    # E[R ‖g‖²] = 0.2 · 0.9 = 0.18, so b* = 0.18 / 0.7; ‖∇J‖² = 0.16² + 0.06² + 0.08² + 0.02² = 0.036
    assert lab.optimal_baseline(P001, R001) == pytest.approx(0.18 / 0.7, abs=TOL)
    # total variance = E[(R - b)² ‖g‖²] - 0.036:
    #   b = 0:   0.18 - 0.036 = 0.144
    #   b = 0.2: 0.64 · 0.18 + 0.04 · (0.21 + 0.20 + 0.11) - 0.036 = 0.1
    #   b*:      0.18 - 0.18² / 0.7 - 0.036 = 0.0977142857...
    assert lab.total_estimator_variance(P001, R001, 0.0) == pytest.approx(0.144, abs=TOL)
    assert lab.total_estimator_variance(P001, R001, 0.2) == pytest.approx(0.1, abs=TOL)
    b_star = lab.optimal_baseline(P001, R001)
    assert lab.total_estimator_variance(P001, R001, b_star) == pytest.approx(0.18 - 0.18**2 / 0.7 - 0.036, abs=TOL)


@pytest.mark.parametrize("seed", range(5))
def test_optimal_baseline_minimises_a_loop_of_the_variance(seed):
    probs, rewards = random_policy(seed, 5)
    p, r = probs.tolist(), rewards.tolist()

    def loop_total(b):  # Σ_a p_a (R_a - b)² ‖onehot(a) - p‖² - ‖∇J‖²
        J = sum(pa * ra for pa, ra in zip(p, r))
        grad = [pa * (ra - J) for pa, ra in zip(p, r)]
        second = sum(p[a] * (r[a] - b) ** 2 * sum(((a == j) - p[j]) ** 2 for j in range(5)) for a in range(5))
        return second - sum(x * x for x in grad)

    b_star = lab.optimal_baseline(p, r)
    for b in (0.0, 1.0, b_star):
        assert lab.total_estimator_variance(p, r, b) == pytest.approx(loop_total(b), abs=1e-12)
    for db in (-0.1, -1e-3, 1e-3, 0.1):
        assert loop_total(b_star + db) > loop_total(b_star)


def test_sgd_baseline_path_by_hand():
    # lr 0.25: b <- b - 0.5 (b - R); rewards 1 then 0 from b = 0: 0.5, then 0.25
    assert lab.sgd_baseline_path([1.0, 0.0], lr=0.25) == [0.0, 0.5, 0.25]


def test_expected_learned_baseline_by_enumerating_every_two_step_draw():
    # E[b_2] = 0.2 + (1 - 2 · 0.25)² (0 - 0.2) = 0.15, over all 16 pairs of actions
    want = lab.expected_learned_baseline(P001, R001, lr=0.25, t=2)
    assert want == pytest.approx(0.15, abs=TOL)
    got = sum(P001[a] * P001[c] * lab.sgd_baseline_path([R001[a], R001[c]], lr=0.25)[-1]
              for a, c in itertools.product(range(4), repeat=2))
    assert got == pytest.approx(want, abs=TOL)


@pytest.mark.parametrize("seed", range(3))
def test_learned_baseline_converges_to_the_expected_reward(seed):
    path = lab.learned_baseline_sgd(P001, R001, lr=0.005, steps=5000, seed=seed)
    assert len(path) == 5001 and path[0] == 0.0
    tail = sum(path[2501:]) / 2500
    assert abs(tail - 0.2) < 0.02  # the stationary sd is 0.028; a 2500-step mean ~ 0.008
    assert abs(lab.optimal_baseline(P001, R001) - tail) > 0.03  # it finds E[R], not b*


# --- report --------------------------------------------------------------------------------------


def test_report_prints_the_seed_figures():
    lines = lab.report()
    assert all(isinstance(fig, str) and isinstance(src, str) for fig, src in lines)
    text = lab.format_report()
    assert text.count("\n") == len(lines) - 1
    for figure in [
        "(0.16, -0.06, -0.08, -0.02)",
        "0.203624",
        "variance 0.1024",
        "variance 0.0576",
        "variance 0.2304",
        "0.5 × gradient",
        "[0.003, 0.003, 0.994]",
        "total variance 0.144  (b = 0)",
        "total variance 0.1  (b = E[R] = 0.2)",
        "total variance 0.0977143  (b* = 0.257143)",
        "learned baseline b_5000",
        "mean of the last 2500 0.1962",
    ]:
        assert figure in text, figure


# --- bad input and module boundaries -------------------------------------------------------------


@pytest.mark.parametrize(
    "probs, rewards, name",
    [
        ((0.5, 0.6), (1.0, 0.0), "probs"),  # sums to 1.1
        ((1.2, -0.2), (1.0, 0.0), "probs"),  # negative
        ((float("nan"), 1.0), (1.0, 0.0), "probs"),
        (((0.5, 0.5),), (1.0,), "probs"),  # 2-D
        ((0.5, 0.5), (1.0, 0.0, 0.0), "rewards"),  # length mismatch
        ((0.5, 0.5), (1.0, float("inf")), "rewards"),
    ],
)
@pytest.mark.parametrize(
    "fn",
    [
        lab.exact_gradient,
        lab.expected_reward,
        lab.finite_difference_gradient,
        lab.gradient_step,
        lambda p, r: lab.estimator_moments(p, r, 0.0),
        lambda p, r: lab.group_estimator_moments(p, r, 2),
    ],
)
def test_bad_policy_raises_naming_argument(fn, probs, rewards, name):
    with pytest.raises(ValueError, match=name):
        fn(probs, rewards)


def test_bad_scalars_raise():
    with pytest.raises(ValueError, match="baseline"):
        lab.estimator_moments(P001, R001, float("nan"))
    with pytest.raises(ValueError, match="group_size"):
        lab.group_estimator_moments(P001, R001, 0)
    with pytest.raises(ValueError, match="group_size"):
        lab.group_estimator_moments(P001, R001, 20)  # 4**20 tuples
    with pytest.raises(ValueError, match="group_size"):
        lab.bandit(group_size=0)
    with pytest.raises(ValueError, match="threshold"):
        lab.lock_in_rates(lr=0.5, seeds=1, threshold=0.4)
    with pytest.raises(ValueError, match="scheme"):
        lab.bandit(steps=1, scheme="nope")
    with pytest.raises(ValueError, match="lr"):
        lab.sgd_baseline_path([1.0], lr=float("nan"))
    with pytest.raises(ValueError, match="steps"):
        lab.learned_baseline_sgd(P001, R001, steps=-1)
    with pytest.raises(ValueError, match="probs"):
        lab.optimal_baseline((0.5, 0.6), (1.0, 0.0))
    with pytest.raises(ValueError, match="baseline"):
        lab.total_estimator_variance(P001, R001, float("inf"))


def test_lab_does_not_import_config_or_trainer():
    tree = ast.parse(Path(lab.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            names.update(f"{node.module}.{a.name}" for a in node.names)
    assert not any("config" in n or "trainer" in n for n in names), names
