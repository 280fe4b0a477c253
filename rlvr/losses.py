"""Losses: the clipped policy-gradient surrogate, its aggregation over tokens, KL to a reference.

Shapes: B = P*G rows, T response tokens, V vocabulary; `mask (B, T)` is 1 on generated tokens
only, so prompt and padding positions never enter a sum, a mean, a ratio or a statistic.

The policy loss, per generated token t of row b (PPO / GRPO):

    ratio[b,t]  = exp(logp[b,t] - logp_old[b,t])                      π / π_old
    loss[b,t]   = -min(ratio * Δ, clip(ratio, 1 - eps_low, 1 + eps_high) * Δ)   objective ppo_clip
    loss        = aggregate(loss[b,t], mask, agg)                     see AGGREGATIONS

Choices that change the gradient:
1. `logp_old`, `logp_ref` and Δ are detached inside: they are constants of the update. Were
   logp_old not detached, the ratio would be identically 1 with zero gradient ("the ratio
   collapses to one"). With logp_old = logp.detach() (the first of μ passes) the ratio is 1, the
   per-token loss is -Δ and the gradient is -Δ ∇logp, weighted as `agg` weighs tokens: it learns.
   The loss VALUE there is aggregate(-Δ), which depends on the mode; with one Δ_b per response
   and |y_b| generated tokens in row b:
       seq_mean_mean   -(1/B) Σ_b Δ_b                     = -mean(Δ), 0 for centered Δ
       token_mean      -Σ_b |y_b| Δ_b / Σ_b |y_b|          a length-weighted mean of Δ, not 0
                                                           for centered Δ unless the lengths agree
       seq_sum_mean    -(1/B) Σ_b |y_b| Δ_b                 (seq_sum_const: that / max_len)
   So a non-zero first-step loss under token_mean is normal (longer responses had larger or
   smaller Δ), and its value says nothing about learning; read the gradient norm. (Objective
   cispo has the same gradient at ratio 1 but the per-token value -Δ · logp.)
2. Clipping zeroes the gradient of a token only where it is active: Δ > 0 and ratio > 1 + eps_high,
   or Δ < 0 and ratio < 1 - eps_low. eps_high defaults to eps_low; a larger eps_high is DAPO's
   "clip higher". `dual_clip_c = c` adds the dual clip: for Δ < 0 the loss is capped at -c·Δ, so
   a token with ratio > c gets no gradient (`ppo_clip`).
3. level="sequence" is GSPO: one ratio per row, s_b = exp(mean over the row's generated tokens of
   (logp - logp_old)) = (π(y|x) / π_old(y|x))^(1/|y|), clipped at the sequence level and used for
   every token of the row. With agg="seq_mean_mean" this is exactly GSPO's per-sequence
   objective; with token_mean the rows are weighted by their length.
4. Δ may be (B,) (one outcome reward per response, the same weight on every token — credit by
   association) or (B, T) (per-token Δ, e.g. process rewards).
5. The aggregation mode (below) decides how tokens are weighted; it is not cosmetic.
6. The KL term is a separate scalar (`kl_loss`); the caller adds kl_coef * kl_loss.
   KL_ESTIMATORS documents which gradient each estimator really gives. The alternative, KL folded
   into the reward as a per-token Δ, is `rlvr.advantages.kl_reward_delta`.
7. `objective` picks the per-token loss (OBJECTIVES): "ppo_clip" (above) or "cispo", which
   replaces the min/clip by a stop-gradient clipped weight, -sg(clip(ratio)) · Δ · logp, so no
   token loses its gradient.
8. An entropy bonus is a separate scalar (`entropy_bonus` of `rlvr.logprobs.entropy_from_logits`);
   the caller subtracts entropy_coef * entropy_bonus.

The log-probs themselves come from rlvr.logprobs (`token_logprobs`: float32, float64 stays float64,
`chunk_rows=...` bounds the float32 (rows, V) working set for large vocabularies).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# --- sequence log-probs (the token log-probs themselves: rlvr.logprobs) ----------------------


def sequence_logprob(logp: Tensor, mask: Tensor) -> Tensor:
    """log π(response) = sum of the generated tokens' log-probs: (B, T), (B, T) -> (B,)."""
    _check_same_shape("logp", logp, mask=mask)
    return torch.where(mask.bool(), logp, torch.zeros_like(logp)).sum(dim=-1)  # (B,)


# --- aggregation: (B, T) per-token values -> scalar -----------------------------------------
# Rows with no generated token contribute 0 and still count in B (no NaN, no data-dependent B).


def seq_sum_mean(values: Tensor, mask: Tensor, max_len: int | None = None) -> Tensor:
    """Sum over each row's tokens, mean over the B rows: every token weighs 1/B.

    With Δ this is REINFORCE on the sequence log-prob, log π(y|x) = Σ_t log π(y_t|...): the
    unbiased gradient of the expected reward. The loss and gradient scale with response length,
    so longer responses move the parameters more and the step size must shrink as T grows.
    """
    return _masked(values, mask).sum(dim=-1).mean()


def seq_mean_mean(values: Tensor, mask: Tensor, max_len: int | None = None) -> Tensor:
    """Mean over each row's tokens, mean over rows (GRPO paper): a token weighs 1/(B·|y_b|).

    Every response counts once whatever its length, so a token of a long response counts less.
    With negative Δ a long wrong answer is pushed down less per token than a short one — the
    length bias that Dr. GRPO points out. Not the gradient of the expected reward.
    """
    count = mask.bool().sum(dim=-1).clamp(min=1).to(values.dtype)  # (B,)
    return (_masked(values, mask).sum(dim=-1) / count).mean()


def token_mean(values: Tensor, mask: Tensor, max_len: int | None = None) -> Tensor:
    """Mean over all generated tokens of the batch (DAPO): a token weighs 1/Σ_b |y_b|.

    Every token counts the same, so long responses get proportionally more say than under
    seq_mean_mean; the weight still depends on the batch's total length (data-dependent scale).
    """
    count = mask.bool().sum().clamp(min=1).to(values.dtype)
    return _masked(values, mask).sum() / count


def seq_sum_const(values: Tensor, mask: Tensor, max_len: int | None = None) -> Tensor:
    """Sum over each row's tokens / max_len, mean over rows (Dr. GRPO): a token weighs 1/(B·max_len).

    A constant normalizer: the gradient is seq_sum_mean's (unbiased REINFORCE) divided by the
    fixed max_len, so no length bias and a scale that does not depend on the batch.
    """
    if max_len is None or isinstance(max_len, bool) or not max_len > 0:
        raise ValueError(f"max_len must be a number > 0 for agg 'seq_sum_const', got {max_len!r}")
    return _masked(values, mask).sum(dim=-1).mean() / max_len


AGGREGATIONS = {
    "seq_sum_mean": seq_sum_mean,
    "seq_mean_mean": seq_mean_mean,
    "token_mean": token_mean,
    "seq_sum_const": seq_sum_const,
}


def denominator(mask: Tensor, mode: str) -> Tensor:
    """What `mode` divides the masked per-token sum by, up to a constant: the token count Σ_b |y_b|
    for token_mean, the row count B for the others (seq_mean_mean first divides each row by its own
    length, seq_sum_const also by the fixed max_len). Each mode's loss on rows split over ranks r is
    Σ_r loss_r · denominator_r / Σ_r denominator_r: the number a learner group all-reduces so that
    every rank weighs its tokens as one process would (averaging per-rank means would not when the
    ranks hold different numbers of tokens)."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown agg mode {mode!r}; known modes: {', '.join(AGGREGATIONS)}")
    if mode == "token_mean":
        return mask.bool().sum().to(torch.float64)
    return torch.tensor(float(mask.shape[0]), dtype=torch.float64)


def aggregate(values: Tensor, mask: Tensor, mode: str, *, max_len: int | None = None) -> Tensor:
    """(B, T) per-token values -> scalar under `mode` (a key of AGGREGATIONS).

    max_len is required by seq_sum_const and ignored by the other modes.
    """
    _check_same_shape("values", values, mask=mask)
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown agg mode {mode!r}; known modes: {', '.join(AGGREGATIONS)}")
    return AGGREGATIONS[mode](values, mask, max_len)


# --- the policy objectives: per-token loss from ratio and Δ -----------------------------------
# Each takes (logp, ratio, delta) of shape (B, T), logp already zero outside the mask, and returns
# the (B, T) per-token loss; `policy_loss` aggregates it. One is picked by name (OBJECTIVES).


def ppo_clip(
    logp: Tensor, ratio: Tensor, delta: Tensor, *, eps_low: float, eps_high: float, dual_clip_c: float | None
) -> Tensor:
    """PPO's clipped surrogate, with Ye et al.'s dual clip for negative Δ when dual_clip_c is set.

        loss = -min(ratio * Δ, clip(ratio, 1 - eps_low, 1 + eps_high) * Δ)
        dual clip (Δ < 0 only):  loss = min(loss, -c * Δ)  =  |Δ| * min(max(ratio, clip(ratio)), c)

    The gradient is -ratio * Δ * ∇logp where no bound is active and 0 where one is. The dual clip
    caps what one token with Δ < 0 can contribute once π has already raised it far above π_old
    (ratio > c): without it the loss -ratio * Δ grows without bound in the ratio and a few stale
    tokens dominate the update. Use it with several passes per batch (μ > 1) or off-policy data,
    where ratios far from 1 occur; at μ = 1 the first step has ratio 1 and nothing changes.
    c must exceed 1 (verl's clip_ratio_c, default 3).
    """
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)  # (B, T)
    per_token = -torch.minimum(ratio * delta, clipped * delta)  # (B, T)
    if dual_clip_c is not None:
        per_token = torch.where(delta < 0, torch.minimum(per_token, -dual_clip_c * delta), per_token)
    return per_token


def cispo(
    logp: Tensor, ratio: Tensor, delta: Tensor, *, eps_low: float, eps_high: float, dual_clip_c: float | None
) -> Tensor:
    """CISPO (MiniMax-M1): clip the importance weight, stop its gradient, keep every token's gradient.

        loss = -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * Δ * logp

    Gradient: -clip(ratio) * Δ * ∇logp. Where PPO's clip is inactive this is PPO's gradient
    (∇ratio = ratio ∇logp); where PPO would zero the token, CISPO still moves it with the weight
    truncated at the bound. Use it when clipping silences the tokens that matter (rare, high-Δ
    "fork" tokens whose ratio moves fast over μ > 1 passes); pair it with a wide upper bound
    (MiniMax and TRL's recommendation: 1 + eps_high around 5). The loss VALUE is -Σ w Δ logp, not
    comparable with ppo_clip's -Σ ratio Δ; only the gradients are. No dual clip (nothing to cap:
    the weight is already bounded).
    """
    if dual_clip_c is not None:
        raise ValueError("dual_clip_c applies to objective 'ppo_clip' only; cispo's weight is already bounded")
    weight = ratio.clamp(1 - eps_low, 1 + eps_high).detach()  # (B, T) stop-gradient importance weight
    return -weight * delta * logp


OBJECTIVES = {"ppo_clip": ppo_clip, "cispo": cispo}


# --- the clipped policy-gradient loss -------------------------------------------------------


def policy_loss(
    logp: Tensor,
    logp_old: Tensor,
    delta: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    level: str = "token",
    agg: str = "token_mean",
    max_len: int | None = None,
    objective: str = "ppo_clip",
    dual_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Policy loss under `objective` (a key of OBJECTIVES) and its diagnostics: (scalar, stats).

    logp, logp_old, mask: (B, T); delta: (B,) per response or (B, T) per token. logp_old and
    delta are detached here (constants of the update). level "token" (PPO/GRPO) or "sequence"
    (GSPO, module docstring item 3). dual_clip_c (> 1, ppo_clip only) caps the loss of Δ < 0
    tokens at -c * Δ. Stats, over generated tokens, under no_grad:
      clip_frac_low   Δ < 0 and ratio < 1 - clip_eps (ppo_clip: clip active below, no gradient);
                      cispo: ratio < 1 - clip_eps whatever Δ (weight truncated, gradient kept)
      clip_frac_high  Δ > 0 and ratio > 1 + clip_eps_high (ppo_clip: no gradient);
                      cispo: ratio > 1 + clip_eps_high whatever Δ (weight truncated)
      clip_frac_dual  Δ < 0 and ratio > dual_clip_c (dual clip active, no gradient); 0 when off
      clip_frac       the sum of the three
      approx_kl_old   mean of (ratio - 1) - log ratio over tokens: Schulman's k3 estimate of
                      KL(π_old || π), unbiased and >= 0 since the tokens were sampled from π_old;
                      always from the per-token ratio, also at level "sequence"
      ratio_mean, ratio_min, ratio_max   of the ratio actually used, over generated tokens (at
                      "sequence" each row's one ratio counts once per token of the row)
    With no generated token the fractions and KL are 0.0 and the ratio stats 1.0.
    """
    _check_same_shape("logp", logp, logp_old=logp_old, mask=mask)
    B, T = logp.shape
    if tuple(delta.shape) not in ((B,), (B, T)):
        raise ValueError(f"delta must have shape (B,) = ({B},) or (B, T) = ({B}, {T}), got {tuple(delta.shape)}")
    if not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps!r}")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if not 0 < eps_high < math.inf:
        raise ValueError(f"clip_eps_high must be a finite number > 0, got {clip_eps_high!r}")
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown level {level!r}; known levels: token, sequence")
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown agg mode {agg!r}; known modes: {', '.join(AGGREGATIONS)}")
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; known objectives: {', '.join(OBJECTIVES)}")
    if dual_clip_c is not None and not 1 < dual_clip_c < math.inf:
        raise ValueError(f"dual_clip_c must be a finite number > 1 (or None), got {dual_clip_c!r}")

    m = mask.bool()  # (B, T)
    delta = delta.detach().to(logp.dtype)
    delta = delta[:, None].expand(B, T) if delta.dim() == 1 else delta  # (B, T)
    # zero outside the mask so padding (possibly -inf) never reaches exp or its gradient
    zero = torch.zeros_like(logp)
    log_ratio = torch.where(m, logp - logp_old.detach(), zero)  # (B, T)
    if level == "token":
        ratio = torch.exp(log_ratio)  # (B, T)
    else:
        count = m.sum(dim=-1).clamp(min=1).to(logp.dtype)  # (B,)
        ratio = torch.exp(log_ratio.sum(dim=-1) / count)[:, None].expand(B, T)  # (B, T) same per row
    per_token = OBJECTIVES[objective](torch.where(m, logp, zero), ratio, delta,
                                      eps_low=clip_eps, eps_high=eps_high, dual_clip_c=dual_clip_c)  # (B, T)
    loss = AGGREGATIONS[agg](per_token, mask, max_len)
    return loss, _policy_stats(ratio, delta, log_ratio, m, clip_eps, eps_high, objective, dual_clip_c)


@torch.no_grad()
def _policy_stats(ratio, delta, log_ratio, m, eps_low, eps_high, objective, dual_clip_c) -> dict[str, float]:
    """policy_loss's diagnostics over the generated tokens (see its docstring)."""
    if int(m.sum()) == 0:
        return dict(clip_frac_low=0.0, clip_frac_high=0.0, clip_frac_dual=0.0, clip_frac=0.0,
                    approx_kl_old=0.0, ratio_mean=1.0, ratio_min=1.0, ratio_max=1.0)
    r, d, lr = ratio[m], delta[m], log_ratio[m]  # (n,) generated tokens only
    if objective == "cispo":
        low = (r < 1 - eps_low).float().mean().item()
        high = (r > 1 + eps_high).float().mean().item()
    else:
        low = ((d < 0) & (r < 1 - eps_low)).float().mean().item()
        high = ((d > 0) & (r > 1 + eps_high)).float().mean().item()
    dual = 0.0 if dual_clip_c is None else ((d < 0) & (r > dual_clip_c)).float().mean().item()
    return dict(
        clip_frac_low=low,
        clip_frac_high=high,
        clip_frac_dual=dual,
        clip_frac=low + high + dual,
        approx_kl_old=(torch.expm1(lr) - lr).mean().item(),
        ratio_mean=r.mean().item(),
        ratio_min=r.min().item(),
        ratio_max=r.max().item(),
    )


# --- off-policy correction ------------------------------------------------------------------


def truncated_is_weight(logp_old: Tensor, logp_behav: Tensor, mask: Tensor, cap: float) -> tuple[Tensor, dict]:
    """(B, T) w = min(exp(logp_old - logp_behav), cap) on generated tokens (1 elsewhere), and its statistics.

    The truncated importance weight of a token sampled from π_behav but learned as if from π_old
    (stop-gradient: both are constants). Since w ≥ 0 scales every objective linearly, it is folded
    into a per-token Δ (loss_t = objective(ratio_t, w_t · Δ_t)); the cap bounds the variance a token
    whose probability rose a lot adds, at the price of a bias toward π_behav on those tokens
    (`is_truncated_frac` says how many). Uses: stale batches (rlvr.distributed.staleness) and a
    sampler whose numerics differ from the trainer's (algorithm.logp_old = recompute)."""
    m = mask.bool()                                                           # (B, T)
    log_w = torch.where(m, logp_old - logp_behav, torch.zeros_like(logp_old))  # (B, T)
    raw = torch.exp(log_w)                                                    # (B, T) π_old / π_behav
    w = raw.clamp(max=cap)                                                    # (B, T)
    if not m.any():
        return w, {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_truncated_frac": 0.0,
                   "behav_ratio_min": 1.0, "behav_ratio_max": 1.0}
    return w, {"is_weight_mean": float(w[m].mean()), "is_weight_max": float(w[m].max()),
               "is_truncated_frac": float((raw[m] > cap).float().mean()),
               "behav_ratio_min": float(raw[m].min()), "behav_ratio_max": float(raw[m].max())}


# --- entropy bonus --------------------------------------------------------------------------


def entropy_bonus(entropy: Tensor, mask: Tensor, agg: str = "token_mean", *, max_len: int | None = None) -> Tensor:
    """Scalar entropy bonus: per-token entropy (B, T) over generated tokens, aggregated by `agg`.

    The caller SUBTRACTS entropy_coef * entropy_bonus from the loss (maximising entropy), with the
    same `agg` as the policy term so both weigh tokens alike:

        loss = policy_loss + kl_coef * kl_loss - entropy_coef * aggregate(H, mask, agg)

    Use a small coefficient (1e-3 .. 1e-2) when the sampling entropy collapses early and every
    group agrees (no Δ left); too large a coefficient drives the policy toward uniform noise.
    """
    _check_same_shape("entropy", entropy, mask=mask)
    return aggregate(entropy, mask, agg, max_len=max_len)


# --- KL to a reference policy ---------------------------------------------------------------
# Tokens are sampled from π (the current policy). With log r = logp_ref - logp, the true
# KL(π || π_ref) = E_π[-log r]. "Gradient as a loss" means autograd through logp only, samples
# held fixed (no score-function term), in expectation over y ~ π, which is what a training loop
# does. Verified by enumeration in tests/test_losses.py.


def kl_k1(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """k1 = logp - logp_ref = -log r.

    Value: unbiased for KL(π||π_ref), high variance, negative on some samples.
    Gradient as a loss: ∇logp, whose expectation under π is 0 (score identity): in expectation
    a k1 loss does not pull π toward π_ref at all; it only adds noise.
    """
    return logp - logp_ref


def kl_k2(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """k2 = ½ (logp - logp_ref)² = ½ (log r)².

    Value: biased (E_π[k2] = ½ E_π[(log r)²], not the KL; close to it only when π ≈ π_ref), >= 0,
    low variance. Gradient as a loss: (logp - logp_ref) ∇logp, whose expectation under π is
    exactly ∇ KL(π || π_ref): the on-policy k2 loss gives the true reverse-KL gradient.
    """
    return 0.5 * (logp - logp_ref) ** 2


def kl_k3(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1 = (r - 1) - log r  (Schulman).

    Value: unbiased for KL(π||π_ref) (E_π[r] = 1), >= 0 on every sample, low variance near
    π_ref. Gradient as a loss: (1 - r) ∇logp, whose expectation under π is -E_{π_ref}[∇logp]
    = ∇ KL(π_ref || π): the FORWARD KL's gradient, not the gradient of the KL it estimates.

    Overflow guard (verl's kl_penalty "low_var_kl"): log r is clamped to [-K3_CLAMP, K3_CLAMP]
    before the exp, so one token that π has pushed far below π_ref (log r = 25 gives r ≈ 7e10)
    cannot swamp the loss; beyond the bound its value is constant and its gradient 0.
    """
    log_r = (logp_ref - logp).clamp(-K3_CLAMP, K3_CLAMP)
    return torch.expm1(log_r) - log_r


K3_CLAMP = 20.0
"""Bound on |log r| inside k3 (verl clamps to [-20, 20]); e^20 ≈ 4.9e8 caps one token's value."""


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimate(logp: Tensor, logp_ref: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(π || π_ref) from tokens sampled from π: (B, T) -> (B, T).

    logp_ref is detached (the reference is frozen). See KL_ESTIMATORS for bias and gradient.
    """
    _check_same_shape("logp", logp, logp_ref=logp_ref)
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; known estimators: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logp, logp_ref.detach())


def kl_loss(
    logp: Tensor,
    logp_ref: Tensor,
    mask: Tensor,
    estimator: str = "k3",
    agg: str = "token_mean",
    *,
    max_len: int | None = None,
) -> Tensor:
    """Scalar KL penalty: per-token kl_estimate over generated tokens, aggregated by `agg`.

    The default token_mean averages over the batch, samples and positions. 
    """
    _check_same_shape("logp", logp, logp_ref=logp_ref, mask=mask)
    m = mask.bool()
    # zero both sides outside the mask so padding cannot put inf/NaN into the value or gradient
    zero = torch.zeros_like(logp)
    per_token = kl_estimate(torch.where(m, logp, zero), torch.where(m, logp_ref, zero), estimator)
    return aggregate(per_token, mask, agg, max_len=max_len)


# --- helpers --------------------------------------------------------------------------------


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    """values where mask is set, else exactly 0 (where, not multiply: 0 * inf would be NaN)."""
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def _check_same_shape(name: str, x: Tensor, **others: Tensor) -> None:
    """ValueError naming the argument unless x is 2-D (B, T) and every other has its shape."""
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (B, T), got shape {tuple(x.shape)}")
    for other, t in others.items():
        if tuple(t.shape) != tuple(x.shape):
            raise ValueError(f"{other} must have the shape of {name} {tuple(x.shape)}, got {tuple(t.shape)}")
