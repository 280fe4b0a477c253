"""The lab: finite softmax policies where the policy-gradient math can be checked exactly.

A policy here is one categorical distribution over n actions (whole answers), parameterized by
n independent softmax logits, with a fixed reward R_a per action. Everything is small enough to
enumerate, so each identity the trainer relies on becomes arithmetic we can verify:

1. Exact gradient. d/dlogits of J = Σ_a p_a R_a is  p_a (R_a - J)  (`exact_gradient`), checked
   against central finite differences on the logits in float64 (`finite_difference_gradient`).
   Four-answer policy (docs/background.md): p = (0.2, 0.3, 0.4, 0.1), R = (1, 0, 0, 0) gives J = 0.2, gradient
   (0.16, -0.06, -0.08, -0.02); one ascent step of size 0.1 raises p_0 to ~0.203624.
2. Baselines. The single-sample estimator (R(a) - b)(onehot(a) - p) has mean equal to the exact
   gradient for every b, but its variance moves with b, and not always down: for the first logit
   it is 0.1024, 0.0576, 0.2304 for b = 0, 0.2, 2 (`estimator_moments`).
3. Group baselines. Enumerating every G-tuple of actions, the estimator (1/G) Σ_i Δ_i ∇log π(a_i)
   with Δ from `rlvr.advantages.compute` has expectation (G-1)/G × gradient with the inclusive
   group mean ("centered") and exactly the gradient with leave-one-out ("loo", G > 1)
   (`group_estimator_moments`).
4. The three-action bandit (docs/background.md). The 25-line listing (3 actions, reward only for action 2, groups of 8,
   lr 0.5, 200 steps, random.seed(0)) reproduced float for float, but with Δ taken from
   rlvr's own `advantages.compute` rather than a copy of the listing: final probabilities
   [0.003, 0.003, 0.994] (`bandit`). `lock_in_rates` / `bandit_exercise` run its exercise
   (lr 5.0 against lr 0.5 over many seeds) and count how often the policy locks onto a wrong action.
   Finding: with the listing's own setup (one rewarded action, 0/1 reward, centered Δ) lock-in
   cannot happen at any lr: Σ_i Δ_i = 0, so a step moves logits by (lr/G) Σ_i Δ_i onehot(a_i),
   which raises the rewarded logit and lowers the others, and p(rewarded) never decreases
   (0 of 200 seeds lock at lr 5.0 or 0.5; lr 5.0 just converges faster). Lock-in onto a wrong
   action does appear without a baseline when wrong answers also earn reward, where every sample
   pushes its own action up: raw Δ, rewards (0.5, 0.5, 1), G = 2 locks 18.5% of seeds at lr 5.0
   and 0% at lr 0.5. `report(exercise_seeds=200)` prints both.

5. Learned and optimal baselines. A scalar baseline b fitted by SGD on the squared error
   (b - R)² to one sampled reward per step (`learned_baseline_sgd`, what rlvr.value's critic does
   per prompt) has E[b_t] = E[R] + (1 - 2 lr)^t (b_0 - E[R]) (`expected_learned_baseline`), so it
   converges to E[R] = 0.2 on the 4-answer policy, fluctuating with variance lr Var(R) / (1 - lr).
   E[R] is not the variance-minimising constant: the total variance over the logits of the
   one-sample estimator is E[(R - b)² ‖∇log π‖²] - ‖∇J‖², minimised at
   b* = E[R ‖∇log π‖²] / E[‖∇log π‖²] (`optimal_baseline`) = 0.18 / 0.7 = 0.257143; by
   enumeration (`total_estimator_variance`) it is 0.144, 0.1 and 0.0977143 for b = 0, E[R], b*.

Limits. This establishes arithmetic consistency in a finite example, not capability: one state,
independent logits (no shared network, no tokens, no sequence lengths), exact expectations rather
than training curves. It says nothing about the full GRPO objective (ratios, clipping, KL), and a
std-normalized Δ is only enumerated here, not analysed. Nothing in this module imports the config
or the trainer; functions take plain numbers and return float64 tensors or Python floats.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from typing import Sequence

import torch
from torch import Tensor

from rlvr import advantages

DTYPE = torch.float64
PROB_SUM_TOL = 1e-6  # how far from 1 a probability vector may sum (decimal inputs are inexact)
MAX_TUPLES = 200_000  # refuse group enumerations larger than this (n_actions ** group_size)

FOUR_ANSWER_PROBS = (0.2, 0.3, 0.4, 0.1)
FOUR_ANSWER_REWARDS = (1.0, 0.0, 0.0, 0.0)
FOUR_ANSWER_BASELINES = (0.0, 0.2, 2.0)
BANDIT_REWARDS = (0.0, 0.0, 1.0)  # reward 1 only for action 2

ArrayLike = Tensor | Sequence[float]


# --- validation ------------------------------------------------------------------------------


def _as_probs(probs: ArrayLike) -> Tensor:
    """Validated (n,) float64 probability vector; ValueError naming `probs` otherwise."""
    try:
        p = torch.as_tensor(probs, dtype=DTYPE).detach().clone()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"probs must be a 1-D sequence of numbers: {exc}") from None
    if p.dim() != 1 or p.numel() < 1:
        raise ValueError(f"probs must be a non-empty 1-D vector, got shape {tuple(p.shape)}")
    if not bool(torch.isfinite(p).all()):
        raise ValueError("probs contain NaN or inf")
    if bool((p < 0).any()):
        raise ValueError(f"probs must be non-negative, got {p.tolist()}")
    total = p.sum().item()
    if abs(total - 1.0) > PROB_SUM_TOL:
        raise ValueError(f"probs must sum to 1, got sum {total!r}")
    return p


def _as_rewards(rewards: ArrayLike, n: int) -> Tensor:
    """Validated (n,) float64 reward vector; ValueError naming `rewards` otherwise."""
    try:
        r = torch.as_tensor(rewards, dtype=DTYPE).detach().clone()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"rewards must be a 1-D sequence of numbers: {exc}") from None
    if r.dim() != 1:
        raise ValueError(f"rewards must be a 1-D vector, got shape {tuple(r.shape)}")
    if r.numel() != n:
        raise ValueError(f"rewards must have one entry per action: len(rewards) = {r.numel()}, len(probs) = {n}")
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards contain NaN or inf")
    return r


def _policy(probs: ArrayLike, rewards: ArrayLike) -> tuple[Tensor, Tensor]:
    p = _as_probs(probs)
    return p, _as_rewards(rewards, p.numel())


def _as_finite(name: str, value: float) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return x


def _as_count(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


# --- one finite policy: exact quantities -----------------------------------------------------


def softmax(logits: ArrayLike) -> Tensor:
    """float64 softmax of a (n,) logit vector (entries may be -inf for impossible actions)."""
    return torch.softmax(torch.as_tensor(logits, dtype=DTYPE), dim=-1)


def expected_reward(probs: ArrayLike, rewards: ArrayLike) -> float:
    """J = Σ_a p_a R_a. Four-answer policy (docs/background.md): 0.2."""
    p, r = _policy(probs, rewards)
    return float(p @ r)


def exact_gradient(probs: ArrayLike, rewards: ArrayLike) -> Tensor:
    """∂J/∂logits for a softmax policy with these probabilities: p_a (R_a - Σ_b p_b R_b).

    Four-answer policy (docs/background.md): (0.16, -0.06, -0.08, -0.02). Sums to 0 (shifting every logit changes nothing).
    """
    p, r = _policy(probs, rewards)
    return p * (r - p @ r)


def finite_difference_gradient(probs: ArrayLike, rewards: ArrayLike, *, eps: float = 1e-6) -> Tensor:
    """Central differences of J(softmax(logits)) on each logit, logits = log(probs), in float64.

    Independent of the analytic formula: it only evaluates Σ softmax(l)·R at perturbed logits.
    Truncation error is O(eps²), rounding O(1e-16 / eps); eps = 1e-6 agrees to ~1e-10.
    """
    p, r = _policy(probs, rewards)
    eps = _as_finite("eps", eps)
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    logits = torch.log(p)  # -inf where p = 0; softmax keeps those actions at 0
    grad = torch.empty_like(p)
    for i in range(p.numel()):
        bump = torch.zeros_like(p)
        bump[i] = eps
        grad[i] = (softmax(logits + bump) @ r - softmax(logits - bump) @ r) / (2 * eps)
    return grad


def gradient_step(probs: ArrayLike, rewards: ArrayLike, lr: float = 0.1) -> Tensor:
    """Probabilities after one exact gradient-ascent step on the logits: softmax(log p + lr ∇J).

    The four-answer policy with lr 0.1: p_0 goes from 0.2 to ~0.203624.
    """
    p, r = _policy(probs, rewards)
    lr = _as_finite("lr", lr)
    return softmax(torch.log(p) + lr * exact_gradient(p, r))


def score_matrix(probs: ArrayLike) -> Tensor:
    """(n, n): row a is ∇_logits log π(a) = onehot(a) - p."""
    p = _as_probs(probs)
    return torch.eye(p.numel(), dtype=DTYPE) - p[None, :]


def estimator_moments(probs: ArrayLike, rewards: ArrayLike, baseline: float) -> tuple[Tensor, Tensor]:
    """Per-logit (mean, variance) of the one-sample estimator (R(a) - b)(onehot(a) - p), a ~ p.

    Exact, by enumerating the n actions. The mean equals `exact_gradient` for every baseline b
    (E[onehot(a) - p] = 0); the variance does not. Four-answer policy, first logit: 0.1024, 0.0576, 0.2304
    for b = 0, 0.2, 2.
    """
    p, r = _policy(probs, rewards)
    b = _as_finite("baseline", baseline)
    samples = (r - b)[:, None] * score_matrix(p)  # (n, n): row a is the estimate when a is drawn
    mean = p @ samples  # (n,)
    variance = p @ (samples - mean) ** 2  # (n,)
    return mean, variance


def group_estimator_moments(
    probs: ArrayLike,
    rewards: ArrayLike,
    group_size: int,
    scheme: str = "centered",
    *,
    baseline: float | None = None,
    top_k: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-logit (mean, variance) of the group estimator (1/G) Σ_i Δ_i (onehot(a_i) - p).

    Exact, by enumerating all n**G tuples of G independent draws a_i ~ p, each weighted by
    Π p_{a_i}. Δ for a tuple is `rlvr.advantages.compute` on its (1, G) reward row under
    `scheme` (`baseline` is the scheme "baseline"'s b; `top_k` is passed through). Expectation:
    (G-1)/G × exact gradient for "centered", exactly the gradient for "loo" (G > 1) and "raw".
    """
    p, r = _policy(probs, rewards)
    G = _as_count("group_size", group_size, 1)
    n = p.numel()
    if n**G > MAX_TUPLES:
        raise ValueError(f"group_size {G} with {n} actions needs {n**G} tuples (limit {MAX_TUPLES})")
    b = None if baseline is None else torch.tensor([_as_finite("baseline", baseline)], dtype=DTYPE)
    scores = score_matrix(p)  # (n, n)
    weights, estimates = [], []
    for acts in itertools.product(range(n), repeat=G):
        idx = torch.tensor(acts)
        delta = advantages.compute(r[idx][None, :], scheme, baseline=b, top_k=top_k)[0]  # (G,)
        estimates.append(delta.to(DTYPE) @ scores[idx] / G)  # (n,)
        weights.append(torch.prod(p[idx]))
    w = torch.stack(weights)  # (n**G,)
    x = torch.stack(estimates)  # (n**G, n)
    mean = w @ x
    variance = w @ (x - mean) ** 2
    return mean, variance


def total_estimator_variance(probs: ArrayLike, rewards: ArrayLike, baseline: float) -> float:
    """Σ over the logits of Var[(R(a) - b)(onehot(a) - p)], a ~ p: the trace of the covariance.

    Exact, by enumeration (`estimator_moments`); equals E[(R - b)² ‖∇log π‖²] - ‖∇J‖², a quadratic
    in b minimised by `optimal_baseline`. On the 4-answer policy: 0.144 (b = 0), 0.1 (b = 0.2).
    """
    _, variance = estimator_moments(probs, rewards, baseline)
    return float(variance.sum())


def optimal_baseline(probs: ArrayLike, rewards: ArrayLike) -> float:
    """b* = E[R ‖∇log π‖²] / E[‖∇log π‖²], the constant minimising `total_estimator_variance`.

    With ∇log π(a) = onehot(a) - p, ‖∇log π(a)‖² = 1 - 2 p_a + Σ p². On the 4-answer policy the
    norms are 0.9, 0.7, 0.5, 1.1, so b* = 0.2 · 0.9 / 0.7 = 0.257143: the rewarded answer has a
    larger score norm than average, and b* leans toward its reward.
    """
    p, r = _policy(probs, rewards)
    norms = (score_matrix(p) ** 2).sum(dim=1)  # (n,) ‖∇log π(a)‖²
    return float((p * r * norms).sum() / (p * norms).sum())


def sgd_baseline_path(sampled_rewards: Sequence[float], *, lr: float, b0: float = 0.0) -> list[float]:
    """b after each SGD step on (b - R_t)² for the given rewards: b <- b - lr · 2 (b - R_t).

    Returns [b_0, b_1, ..., b_T]. A scalar stand-in for rlvr.value's critic on one prompt.
    """
    lr = _as_finite("lr", lr)
    b = _as_finite("b0", b0)
    path = [b]
    for x in sampled_rewards:
        b = b - lr * 2.0 * (b - float(x))
        path.append(b)
    return path


def learned_baseline_sgd(probs: ArrayLike, rewards: ArrayLike, *, lr: float = 0.005, steps: int = 5000,
                         seed: int = 0, b0: float = 0.0) -> list[float]:
    """`sgd_baseline_path` on `steps` rewards R(a_t), a_t ~ p drawn with random.Random(seed)."""
    p, r = _policy(probs, rewards)
    steps = _as_count("steps", steps, 0)
    rng = random.Random(seed)
    acts = rng.choices(range(p.numel()), weights=p.tolist(), k=steps)
    return sgd_baseline_path([r[a].item() for a in acts], lr=lr, b0=b0)


def expected_learned_baseline(probs: ArrayLike, rewards: ArrayLike, *, lr: float, t: int, b0: float = 0.0) -> float:
    """E[b_t] of `learned_baseline_sgd`: E[R] + (1 - 2 lr)^t (b0 - E[R]) (the update is linear in b)."""
    J = expected_reward(probs, rewards)
    return J + (1 - 2 * _as_finite("lr", lr)) ** _as_count("t", t, 0) * (_as_finite("b0", b0) - J)


# --- the three-action bandit --------------------------------------------------------------------


def _listing_probs(logits: list[float]) -> list[float]:
    """The listing's softmax in Python floats, same order of operations (bit-for-bit)."""
    m = max(logits)
    e = [math.exp(x - m) for x in logits]
    t = sum(e)
    return [v / t for v in e]


@functools.lru_cache(maxsize=1 << 16)
def _group_delta(row: tuple[float, ...], scheme: str, baseline: float | None, top_k: int | None) -> tuple[float, ...]:
    """Δ of one (1, G) reward row from `advantages.compute`, as Python floats.

    Memoized: Δ is a pure function of the row, and a bandit run revisits the same few rows
    (2**G orderings of 0/1 rewards) thousands of times, so caching saves most of the exercise.
    """
    b = None if baseline is None else torch.tensor([baseline], dtype=DTYPE)
    rewards = torch.tensor([row], dtype=DTYPE)  # (1, G)
    return tuple(advantages.compute(rewards, scheme, baseline=b, top_k=top_k)[0].tolist())


def bandit(
    *,
    lr: float = 0.5,
    group_size: int = 8,
    steps: int = 200,
    seed: int = 0,
    scheme: str = "centered",
    rewards: Sequence[float] = BANDIT_REWARDS,
    baseline: float | None = None,
    top_k: int | None = None,
) -> list[float]:
    """The three-action bandit (docs/background.md); returns the final probabilities (Python floats).

    Each step: p = softmax(logits) once; draw group_size actions with random.choices(weights=p);
    reward R[a] (`rewards` gives one reward per action, default (0, 0, 1)); Δ from
    `rlvr.advantages.compute` on the (1, G) reward row; then, sample by sample and in place,
    logits[j] += lr * Δ_i * (onehot(a_i)_j - p[j]) / G with the p of the top of the step.
    The defaults are the listing's; seed 0 ends at [0.003, 0.003, 0.994] rounded to 3 decimals.
    random.Random(seed) produces the same stream as the listing's random.seed(seed) without
    touching the global generator.
    """
    lr = _as_finite("lr", lr)
    G = _as_count("group_size", group_size, 1)
    steps = _as_count("steps", steps, 0)
    R = [_as_finite("rewards", x) for x in rewards]
    if len(R) < 2:
        raise ValueError(f"rewards must give one reward per action for at least 2 actions, got {R}")
    b = None if baseline is None else _as_finite("baseline", baseline)
    rng = random.Random(seed)
    actions = range(len(R))
    logits = [0.0] * len(R)
    for _ in range(steps):
        p = _listing_probs(logits)
        acts = rng.choices(actions, weights=p, k=G)
        deltas = _group_delta(tuple(R[a] for a in acts), scheme, b, top_k)
        for a, adv in zip(acts, deltas):
            for j in actions:
                grad = (1.0 if j == a else 0.0) - p[j]
                logits[j] += lr * adv * grad / len(acts)
    return _listing_probs(logits)


def lock_in_rates(*, lr: float, seeds: int = 200, threshold: float = 0.9, **bandit_kwargs) -> dict[str, float]:
    """Run `bandit` for seeds 0..seeds-1 at this lr and classify each final policy.

    With `best` the action of highest reward, each run is exactly one of:
      solved        p[best] >= threshold
      locked_wrong  some other action has p >= threshold (committed to a wrong action)
      unsettled     neither (threshold > 0.5 makes the three classes disjoint)
    Returns the three fractions, mean_p_best (mean final p[best]), lr, seeds and threshold.
    `bandit_kwargs` go to `bandit` (group_size, steps, scheme, rewards, baseline, top_k).
    """
    n = _as_count("seeds", seeds, 1)
    threshold = _as_finite("threshold", threshold)
    if not 0.5 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0.5, 1], got {threshold!r}")
    R = list(bandit_kwargs.get("rewards", BANDIT_REWARDS))
    best = max(range(len(R)), key=R.__getitem__) if R else 0
    solved = wrong = 0
    p_best = 0.0
    for seed in range(n):
        p = bandit(lr=lr, seed=seed, **bandit_kwargs)
        p_best += p[best]
        if p[best] >= threshold:
            solved += 1
        elif max(q for a, q in enumerate(p) if a != best) >= threshold:
            wrong += 1
    return {
        "lr": float(lr),
        "seeds": n,
        "threshold": threshold,
        "solved": solved / n,
        "locked_wrong": wrong / n,
        "unsettled": (n - solved - wrong) / n,
        "mean_p_best": p_best / n,
    }


def bandit_exercise(
    *, lrs: Sequence[float] = (5.0, 0.5), seeds: int = 200, **bandit_kwargs
) -> dict[float, dict[str, float]]:
    """The bandit's learning-rate exercise: `lock_in_rates` at each lr (default 5.0 and 0.5) over the same seeds."""
    return {float(lr): lock_in_rates(lr=lr, seeds=seeds, **bandit_kwargs) for lr in lrs}


def format_exercise(results: dict[float, dict[str, float]]) -> str:
    """One line per lr: the share of seeds solved / locked onto a wrong action / unsettled."""
    lines = []
    for lr, f in results.items():
        lines.append(
            f"lr {lr:g}: solved {f['solved']:.1%}  locked_wrong {f['locked_wrong']:.1%}  "
            f"unsettled {f['unsettled']:.1%}  mean p_best {f['mean_p_best']:.3f}  "
            f"({f['seeds']} seeds, threshold {f['threshold']:g})"
        )
    return "\n".join(lines)


# --- the report `rlvr lab` prints ------------------------------------------------------------


def _fmt(values: Sequence[float] | Tensor, digits: int = 6) -> str:
    vals = values.tolist() if isinstance(values, Tensor) else list(values)
    return "(" + ", ".join(f"{v:.{digits}g}" if v != 0 else "0" for v in vals) + ")"


def report(exercise_seeds: int = 0) -> list[tuple[str, str]]:
    """(figure, what produced it) pairs for seeds 001 and 002, all computed, none typed in.

    With exercise_seeds > 0, also the bandit's learning-rate exercise at lr 5.0 and 0.5 (a few ms per seed
    per lr), for the listing's bandit and for a no-baseline variant where lock-in does occur.
    """
    p, r = FOUR_ANSWER_PROBS, FOUR_ANSWER_REWARDS
    policy = "p=(0.2, 0.3, 0.4, 0.1), R=(1, 0, 0, 0)"
    grad = exact_gradient(p, r)
    fd = finite_difference_gradient(p, r)
    lines = [
        (f"expected reward {expected_reward(p, r):.6g}", f"four-answer policy: Σ p_a R_a at {policy}"),
        (f"gradient {_fmt(grad)}", "four-answer policy: exact p_a (R_a - J) w.r.t. the softmax logits"),
        (
            f"finite differences {_fmt(fd)}  max |diff| {(fd - grad).abs().max().item():.1e}",
            "four-answer policy: central differences on the logits, eps 1e-6, float64",
        ),
        (
            f"p_0 after one step {gradient_step(p, r, 0.1)[0].item():.6f}",
            "four-answer policy: softmax(log p + 0.1 × gradient)",
        ),
    ]
    for b in FOUR_ANSWER_BASELINES:
        mean, var = estimator_moments(p, r, b)
        lines.append(
            (
                f"variance {var[0].item():.6g}  mean {mean[0].item():.6g}  (baseline {b:g})",
                "four-answer policy: first logit of (R(a)-b)(onehot(a)-p), all 4 actions enumerated",
            )
        )
    lines += _baseline_lines(p, r)
    G = 2
    cen, _ = group_estimator_moments(p, r, G, "centered")
    loo, _ = group_estimator_moments(p, r, G, "loo")
    ratio = (cen[0] / grad[0]).item()
    lines += [
        (
            f"centered G=2 mean {_fmt(cen)} = {ratio:.6g} × gradient",
            "four-answer policy: all 16 pairs, Δ = advantages.compute(..., 'centered'); (G-1)/G = 0.5",
        ),
        (
            f"loo G=2 mean {_fmt(loo)}  max |diff| {(loo - grad).abs().max().item():.1e}",
            "four-answer policy: all 16 pairs, Δ = advantages.compute(..., 'loo'); recovers the gradient",
        ),
        (
            f"bandit final probs {[round(x, 3) for x in bandit()]}",
            "bandit: random.seed(0), 3 actions, G=8, lr 0.5, 200 steps, Δ 'centered'",
        ),
    ]
    if exercise_seeds > 0:
        variants = [
            ("listing", {}),
            ("raw Δ, R=(0.5,0.5,1), G=2", {"scheme": "raw", "rewards": (0.5, 0.5, 1.0), "group_size": 2}),
        ]
        for name, kwargs in variants:
            for lr, f in bandit_exercise(seeds=exercise_seeds, **kwargs).items():
                lines.append(
                    (
                        f"lr {lr:g}: locked_wrong {f['locked_wrong']:.1%}  solved {f['solved']:.1%}"
                        f"  unsettled {f['unsettled']:.1%}",
                        f"bandit exercise ({name}): {exercise_seeds} seeds, p >= 0.9 after 200 steps",
                    )
                )
    return lines


def _baseline_lines(p: Sequence[float], r: Sequence[float]) -> list[tuple[str, str]]:
    """The learned baseline's trajectory and the total variance at b = 0, E[R] and b*."""
    lr, steps = 0.005, 5000
    path = learned_baseline_sgd(p, r, lr=lr, steps=steps, seed=0)
    tail = sum(path[steps // 2 + 1:]) / (steps - steps // 2)
    J, b_star = expected_reward(p, r), optimal_baseline(p, r)
    var_r = expected_reward(p, [x * x for x in r]) - J * J
    sd = math.sqrt(lr * var_r / (1 - lr))  # stationary sd of b around E[R]
    lines = [(
        f"learned baseline b_{steps} {path[-1]:.4f}  mean of the last {steps - steps // 2} {tail:.4f}  "
        f"(E[R] {J:.6g}, sd around it {sd:.4f})",
        f"SGD on (b - R)², lr {lr:g}, one sampled reward per step, b_0 = 0, random.Random(0)",
    )]
    for name, b in (("b = 0", 0.0), (f"b = E[R] = {J:.6g}", J), (f"b* = {b_star:.6g}", b_star)):
        lines.append((
            f"total variance {total_estimator_variance(p, r, b):.6g}  ({name})",
            "Σ over the 4 logits of Var[(R(a)-b)(onehot(a)-p)], enumerated; b* = E[R‖∇log π‖²]/E[‖∇log π‖²]",
        ))
    return lines


def format_report(exercise_seeds: int = 0) -> str:
    """`report()` as aligned text: figure, then '<-' and what produced it."""
    lines = report(exercise_seeds)
    width = max(len(fig) for fig, _ in lines)
    return "\n".join(f"{fig:<{width}}  <- {src}" for fig, src in lines)
