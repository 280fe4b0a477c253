"""Advantages: turn a (P, G) reward matrix into the weights Δ of the policy gradient.

Every method in this library updates with  -Δ · ∇ log π(A|S)  (see losses.py); only Δ differs.
Row p holds the G responses sampled for prompt p, so group statistics are reductions over dim 1
(TRL's `rewards.view(-1, G)` idiom). With r the rewards of one group:

    raw               Δ = r                                   (naive REINFORCE)
    baseline          Δ = r - b(S)                            b is a (P,) baseline from the caller
    centered          Δ = r - mean(r)                         group mean as baseline
    normalized        Δ = (r - mean(r)) / (std(r) + EPS)      GRPO
    loo               Δ = r - (sum(r) - r) / (G - 1)          leave-one-out (RLOO)
    batch_normalized  Δ = (r - mean(r)) / (std(all centered values in the batch) + EPS)

Choices that change the gradient:
1. `std` is the unbiased sample std (divides by G - 1), as torch.std, TRL and verl compute it, so
   GRPO numbers match theirs. `batch_normalized` uses the unbiased std over all P*G centered values.
2. EPS = 1e-6 (verl's value) is added to the std, not under a square root. It bounds the scale
   of Δ when a group's rewards barely differ; it makes `normalized` only approximately invariant
   to rescaling the rewards.
3. A group whose rewards are all exactly equal (max == min) gets Δ = 0 exactly under every scheme
   except raw and baseline. Agreement is tested exactly, not with isclose(std, 0): equal
   non-integer rewards such as 0.3 have a float std of ~1e-8, and dividing the ~1e-17 residue
   of the centering by it would give nonsense (or NaN for G = 1 under the unbiased std).
4. The inclusive mean (centered, normalized) scales the expected gradient by (G-1)/G, because
   each sample's own reward sits in its baseline; loo is unbiased and equals G/(G-1) × centered.
5. Dividing by a std (normalized, batch_normalized) is a random per-group weight: it stops the
   update size from tracking the reward scale, and it up-weights groups with a small spread
   (prompts almost always solved or almost never solved).
6. `top_k` (applied after any scheme) keeps Δ only for the top_k highest-REWARD responses of each
   group and zeros the rest. Ties are kept: every response whose reward is >= the k-th largest
   reward of its group keeps its Δ, so more than k may survive. Sample order inside a group is
   arbitrary, so breaking ties by index would favour whichever sample happened to come first.

`compute` is the one entry point; it validates its inputs and raises ValueError naming the bad
argument. The scheme functions in SCHEMES assume validated input.

Beyond the (P, G) schemes:
- learned   Δ = R - V(S) with V a critic trained on the observed rewards (`rlvr.value`); the
            caller passes its detached estimate as the "baseline" scheme's b. Works with G = 1.
- `overlong_penalty` (DAPO) is added to the rewards before any scheme.
- Process rewards (one score per step) become a (B, T) Δ by `per_step_centered` or
            `return_to_go` (PROCESS_DELTAS), with the steps located by `token_steps`.
- `kl_reward_delta` folds β·k1 into Δ per token (KL in the reward, REINFORCE++ style): Δ becomes
            (B, T). REINFORCE++'s baseline is scheme "batch_normalized" followed by it:
                Δ[b,t] = (R_b - mean_group R) / (std over the batch + EPS) - β Σ_{t'>=t} k1[b,t']
            verl's reinforce_plus_plus_baseline differs in two documented ways: it subtracts the
            whole-sequence KL from R BEFORE centring and whitening (so the KL is rescaled with
            the rewards, and each token is charged the KL of earlier tokens too), and it whitens
            over generated tokens (a length-weighted mean and std with N_tokens - 1 in the Bessel
            correction) rather than over responses.
"""

from __future__ import annotations

import bisect
import math
import operator
from typing import Sequence

import torch
from torch import Tensor

EPS = 1e-6  # added to the std in `normalized` and `batch_normalized`


def agreeing_groups(rewards: Tensor) -> Tensor:
    """(P,) bool: True where every reward of the group is exactly equal (that group teaches nothing)."""
    rewards = torch.as_tensor(rewards)
    return rewards.amax(dim=1) == rewards.amin(dim=1)  # (P,)


def nonzero_fraction(delta: Tensor) -> float:
    """Fraction of the entries of Δ that are nonzero: the share of samples that carry a gradient."""
    delta = torch.as_tensor(delta)
    if delta.numel() == 0:
        return 0.0
    return (delta != 0).float().mean().item()


# --- schemes: (P, G) float rewards -> (P, G) delta -------------------------------------------


def raw(rewards: Tensor) -> Tensor:
    """Δ = R. With a 0/1 reward every wrong sample has Δ = 0 and moves nothing."""
    return rewards.clone()


def subtract_baseline(rewards: Tensor, baseline: Tensor) -> Tensor:
    """Δ = R - b(S), with b a (P,) baseline per prompt chosen by the caller."""
    return rewards - baseline[:, None]  # (P, G)


def centered(rewards: Tensor) -> Tensor:
    """Δ = R - mean of the group. Sums to 0 over each group."""
    delta = rewards - rewards.mean(dim=1, keepdim=True)  # (P, G)
    return _zero_agreeing(delta, rewards)


def normalized(rewards: Tensor) -> Tensor:
    """GRPO: Δ = (R - mean) / (unbiased std + EPS) per group; exactly 0 for an agreeing group."""
    agree = agreeing_groups(rewards)[:, None]  # (P, 1)
    mean = rewards.mean(dim=1, keepdim=True)  # (P, 1)
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(mean)
    std = torch.where(agree, torch.ones_like(std), std)  # keep NaN out of the discarded branch
    return torch.where(agree, torch.zeros_like(rewards), (rewards - mean) / (std + EPS))


def leave_one_out(rewards: Tensor) -> Tensor:
    """RLOO: Δ = R - (sum - R) / (G - 1), the mean of the other G - 1 rewards of the group."""
    G = rewards.shape[1]
    others_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (G - 1)  # (P, G)
    return _zero_agreeing(rewards - others_mean, rewards)


def batch_normalized(rewards: Tensor) -> Tensor:
    """Δ = (R - group mean) / (unbiased std of all P*G centered values + EPS); 0 when all agree."""
    delta = centered(rewards)  # (P, G)
    if delta.numel() < 2 or not bool((delta != 0).any()):
        return delta
    return delta / (delta.std() + EPS)


# name -> function of the (P, G) rewards; "baseline" also takes the (P,) baseline (see compute).
SCHEMES = {
    "raw": raw,
    "baseline": subtract_baseline,
    "centered": centered,
    "normalized": normalized,
    "loo": leave_one_out,
    "batch_normalized": batch_normalized,
}


def compute(
    rewards: Tensor | Sequence[Sequence[float]],
    scheme: str,
    *,
    baseline: Tensor | Sequence[float] | None = None,
    top_k: int | None = None,
) -> Tensor:
    """(P, G) rewards -> (P, G) float Δ under `scheme` (a key of SCHEMES), then the top_k filter.

    `baseline` is a (P,) per-prompt baseline, required by the "baseline" scheme and rejected by
    the others. `top_k` in 1..G keeps Δ of the responses whose reward is >= the k-th largest of
    their group (ties kept) and zeros the rest. Integer or bool rewards become the default float
    dtype; float rewards keep their dtype. Raises ValueError naming the argument at fault.
    """
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be 2-D (P, G), got shape {tuple(rewards.shape)}")
    if rewards.shape[0] < 1 or rewards.shape[1] < 1:
        raise ValueError(f"rewards must have P >= 1 and G >= 1, got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or inf")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; known schemes: {', '.join(SCHEMES)}")
    P, G = rewards.shape
    if scheme == "loo" and G == 1:
        raise ValueError("scheme 'loo' needs G >= 2 samples per prompt (rewards has G == 1)")

    if scheme == "baseline":
        if baseline is None:
            raise ValueError("scheme 'baseline' needs a baseline: a (P,) tensor, one value per prompt")
        baseline = torch.as_tensor(baseline, dtype=rewards.dtype)
        if tuple(baseline.shape) != (P,):
            raise ValueError(f"baseline must have shape (P,) = ({P},), got {tuple(baseline.shape)}")
        if not bool(torch.isfinite(baseline).all()):
            raise ValueError("baseline contains NaN or inf")
        delta = subtract_baseline(rewards, baseline)
    else:
        if baseline is not None:
            raise ValueError(f"baseline is only used by scheme 'baseline', not {scheme!r}")
        delta = SCHEMES[scheme](rewards)

    if top_k is not None:
        try:
            k = operator.index(top_k)
        except TypeError:
            raise ValueError(f"top_k must be an int in 1..G = 1..{G}, got {top_k!r}") from None
        if isinstance(top_k, bool) or not 1 <= k <= G:
            raise ValueError(f"top_k must be an int in 1..G = 1..{G}, got {top_k!r}")
        kth = rewards.topk(k, dim=1).values[:, -1:]  # (P, 1) k-th largest reward of each group
        delta = torch.where(rewards >= kth, delta, torch.zeros_like(delta))
    return delta


# --- reward shaping on (P, G) rewards -------------------------------------------------------


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, to ADD to the rewards before the scheme: same shape as lengths.

    With L a response's length in tokens and L_max = max_len:

        0                                           L <= L_max - buffer
        -penalty * (L - (L_max - buffer)) / buffer  L_max - buffer < L <= L_max   (linear ramp)
        -penalty                                    L > L_max

    so a response that reaches max_len (truncated, usually unfinished) scores `penalty` less than
    the same response `buffer` tokens shorter, and the ramp tells the policy which direction is
    shorter without the cliff of a hard truncation penalty. Use it on tasks whose responses end at
    an end token and often run into max_new_tokens; on fixed-length tasks every response has the
    same length, so every group is shifted alike and centred Δ does not change. verl's reward
    manager computes min(-(L - (L_max - buffer)) / buffer * penalty, 0), the same on L <= L_max.
    """
    lengths = torch.as_tensor(lengths)
    for name, v in (("max_len", max_len), ("buffer", buffer)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an int, got {v!r}")
    if not 1 <= buffer <= max_len:
        raise ValueError(f"buffer must be in 1..max_len = 1..{max_len}, got {buffer}")
    if not 0 < penalty < float("inf"):
        raise ValueError(f"penalty must be a finite number > 0, got {penalty!r}")
    if lengths.is_floating_point() or bool((lengths < 0).any()):
        raise ValueError("lengths must be non-negative integers (tokens per response)")
    exceed = (lengths - (max_len - buffer)).to(torch.get_default_dtype())  # tokens into the buffer
    return -(exceed / buffer).clamp(0.0, 1.0) * penalty


# --- per-token Δ: KL folded into the reward --------------------------------------------------


def kl_reward_delta(
    delta: Tensor,
    logp_old: Tensor,
    logp_ref: Tensor,
    mask: Tensor,
    kl_coef: float,
    *,
    return_to_go: bool = True,
) -> Tensor:
    """Fold a k1 KL penalty into the reward, REINFORCE++ style: (B,) or (B, T) Δ -> (B, T) Δ.

    With k1[b,t] = logp_old[b,t] - logp_ref[b,t] on generated tokens (0 elsewhere), β = kl_coef:

        return_to_go=True   Δ[b,t] = Δ[b] - β · Σ_{t' >= t} k1[b,t']       (default)
        return_to_go=False  Δ[b,t] = Δ[b] - β · k1[b,t]

    Why k1 and why the return to go: the KL-regularised objective is E_π[R - β log(π/π_ref)],
    whose score-function gradient is E[(R - β Σ_t k1_t) ∇log π(y)] (the extra E[∇log π] is 0). By
    causality token t can only change the KL of itself and the tokens after it, so the terms before
    t drop out in expectation: the return to go is an unbiased estimate of the exact reverse-KL
    gradient with less variance than the whole-sequence sum. (A k1 term in the LOSS has gradient 0
    in expectation; `losses.kl_k1`.) return_to_go=False charges each token only its own k1: lower
    variance, but it ignores how a token shifts the later tokens' distributions, so it is biased
    (tested by enumeration). The KL is in reward units and is not normalised with Δ.

    Use kl_in = "reward" to keep π near π_ref with an unbiased gradient and a single β (verl's
    use_kl_in_reward, REINFORCE++); kl_in = "loss" (`losses.kl_loss`, k3 by default) to keep the
    Δ a function of the rewards alone. logp_old and logp_ref must be scored under the same
    distribution (same temperature, no nucleus on one side only), or k1 is not the log-ratio of π
    to π_ref. Outside the mask Δ is 0. The REINFORCE++ baseline is scheme "batch_normalized" then
    this function (module docstring).
    """
    if logp_old.dim() != 2:
        raise ValueError(f"logp_old must be 2-D (B, T), got shape {tuple(logp_old.shape)}")
    B, T = logp_old.shape
    for name, x in (("logp_ref", logp_ref), ("mask", mask)):
        if tuple(x.shape) != (B, T):
            raise ValueError(f"{name} must have the shape of logp_old {(B, T)}, got {tuple(x.shape)}")
    if tuple(delta.shape) not in ((B,), (B, T)):
        raise ValueError(f"delta must have shape (B,) = ({B},) or (B, T) = ({B}, {T}), got {tuple(delta.shape)}")
    if not 0 <= kl_coef < float("inf"):
        raise ValueError(f"kl_coef must be a finite number >= 0, got {kl_coef!r}")
    m = mask.bool()
    k1 = torch.where(m, logp_old.detach() - logp_ref.detach(), torch.zeros_like(logp_old))  # (B, T)
    if return_to_go:
        k1 = k1.flip(-1).cumsum(-1).flip(-1)  # (B, T) Σ_{t' >= t}
    delta = delta.detach().to(k1.dtype)
    delta = delta[:, None].expand(B, T) if delta.dim() == 1 else delta  # (B, T)
    return torch.where(m, delta - kl_coef * k1, torch.zeros_like(k1))


# --- process rewards: per-step scores -> per-token Δ -----------------------------------------
# A process reward returns one score per step of a response (rlvr.rewards.steps_of). Steps are
# runs of tokens; `token_steps` says which step each token belongs to, `pad_steps` stacks the
# scores into (P, G, S), and a PROCESS_DELTAS function turns them into a (B, T) Δ for policy_loss.


def token_steps(token_texts: Sequence[Sequence[str]], delimiter: str, T: int) -> Tensor:
    """(B, T) long: the step index of each response token, -1 where a token belongs to no step.

    token_texts[b] holds the text of each generated token of row b, in order, so that their
    concatenation is the response text the reward scored (a special token is ""); T pads the rows.

    delimiter ""   every CHARACTER is a step (per-token scores on fixed-length tasks): a token's step
                   is the offset of its first character, a token with no text (a special) gets
                   -1. With the built-in character tokenizer a token is a character, so step t is
                   the t-th character of the response; a token of several characters takes the step
                   of its first only, so per-character rewards need a one-character-per-token
                   tokenizer.
    otherwise      a step is a piece of text that ends with the delimiter, or the non-empty tail
                   after the last one (the pieces of str.split, the delimiter kept with the piece it
                   closes). A token's step is the number of delimiters that END at or before its
                   first character, so the token that completes a delimiter still belongs to the
                   step it closes, even when the delimiter is split across tokens.
    """
    if not isinstance(delimiter, str):
        raise ValueError(f"delimiter must be a str, got {delimiter!r}")
    out = torch.full((len(token_texts), T), -1, dtype=torch.long)
    for b, texts in enumerate(token_texts):
        if len(texts) > T:
            raise ValueError(f"token_texts[{b}] has {len(texts)} tokens, more than T = {T}")
        text = "".join(texts)
        ends = []  # end offsets of the delimiters, non-overlapping, left to right (as str.split)
        if delimiter:
            i = text.find(delimiter)
            while i >= 0:
                ends.append(i + len(delimiter))
                i = text.find(delimiter, i + len(delimiter))
        offset = 0
        for t, piece in enumerate(texts):
            if delimiter:
                out[b, t] = bisect.bisect_right(ends, offset)
            elif piece:
                out[b, t] = offset
            offset += len(piece)
    return out


def span_steps(spans: Sequence[Sequence[tuple[int, int]]], T: int) -> Tensor:
    """(B, T) long: the step index of each response token when the steps are given as token spans
    (an environment's actions, rlvr.environments.Episode.spans): token t of row b is step k when
    row b's k-th span ``(start, end)`` holds ``start <= t < end``; -1 elsewhere (inserted observations,
    padding)."""
    out = torch.full((len(spans), T), -1, dtype=torch.long)
    for b, row in enumerate(spans):
        for k, (start, end) in enumerate(row):
            if not 0 <= start <= end <= T:
                raise ValueError(f"spans[{b}][{k}] = {(start, end)} is not within 0..T = {T}")
            out[b, start:end] = k
    return out


def pad_steps(steps: Sequence[Sequence[float]], group_size: int) -> tuple[Tensor, Tensor]:
    """B per-response lists of step scores -> (P, G, S) float scores and (P, G, S) bool step_mask.

    Row b is prompt b // G, sample b % G; S is the longest list (at least 1); missing steps are 0
    with step_mask False. An empty list (a failed reward) has no step at all.
    """
    G = group_size
    if isinstance(G, bool) or not isinstance(G, int) or G < 1 or len(steps) % G:
        raise ValueError(f"group_size must be an int >= 1 dividing the {len(steps)} rows, got {group_size!r}")
    S = max([len(x) for x in steps] + [1])
    scores = torch.zeros(len(steps), S, dtype=torch.get_default_dtype())
    step_mask = torch.zeros(len(steps), S, dtype=torch.bool)
    for b, row in enumerate(steps):
        scores[b, : len(row)] = torch.as_tensor(list(row), dtype=scores.dtype)
        step_mask[b, : len(row)] = True
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("steps contain NaN or inf")
    return scores.view(-1, G, S), step_mask.view(-1, G, S)


def per_step_centered(step_scores: Tensor, step_mask: Tensor, token_step: Tensor) -> Tensor:
    """Δ[b,t] = x[b,s] - mean over the group of x[·,s], s = token_step[b,t]: (P, G, S) -> (B, T).

    Each step's score is centred across the G responses of its prompt AT THE SAME STEP INDEX (over
    the responses that have that step), then given to every token of the step. A token is credited
    for its own step only: on the sort task with per-position scores, the digit at position t is
    pushed by whether IT is right, not by the whole response's score. That is low variance and
    exact credit when a step's score depends only on that step (sort positions); it is biased for
    the total when an early step changes how later steps score (use return_to_go). A step index
    where all the group's scores agree, or only one response has it, gets Δ = 0 (G = 1: all 0).
    """
    return _broadcast_steps(_center_steps(step_scores, step_mask), step_mask, token_step)


def return_to_go(step_scores: Tensor, step_mask: Tensor, token_step: Tensor) -> Tensor:
    """Δ[b,t] = Σ_{s' >= s} x[b,s'] centred across the group at step s, s = token_step[b,t].

    The causal credit for the TOTAL of the step scores: a token cannot change earlier steps, so it
    is weighted by the scores of its own and later steps, then a group baseline at the same step
    index (the mean of the others' returns from that step) is subtracted. Unbiased for the sum of
    the step scores (up to the (G-1)/G of the inclusive mean); more variance than
    per_step_centered because later steps' noise reaches early tokens. Use it when steps build on
    each other (reasoning steps); per_step_centered when each step is scored on its own.
    """
    x = torch.where(step_mask, step_scores, torch.zeros_like(step_scores))
    togo = x.flip(-1).cumsum(-1).flip(-1)  # (P, G, S)
    return _broadcast_steps(_center_steps(togo, step_mask), step_mask, token_step)


PROCESS_DELTAS = {"per_step_centered": per_step_centered, "return_to_go": return_to_go}


def process_delta(step_scores: Tensor, step_mask: Tensor, token_step: Tensor, mode: str) -> Tensor:
    """(P, G, S) step scores -> (B, T) Δ under `mode` (a key of PROCESS_DELTAS), validated.

    token_step (B, T) from `token_steps`, with B = P * G. Tokens of no step (-1), of a step the
    reward did not score, or beyond the scored steps get Δ = 0; `step_mismatch` flags such rows.
    """
    if mode not in PROCESS_DELTAS:
        raise ValueError(f"unknown process_delta {mode!r}; known: {', '.join(PROCESS_DELTAS)}")
    if step_scores.dim() != 3:
        raise ValueError(f"step_scores must be 3-D (P, G, S), got shape {tuple(step_scores.shape)}")
    if tuple(step_mask.shape) != tuple(step_scores.shape) or step_mask.dtype != torch.bool:
        raise ValueError(f"step_mask must be a bool tensor of shape {tuple(step_scores.shape)}")
    P, G, S = step_scores.shape
    if token_step.dim() != 2 or token_step.shape[0] != P * G or token_step.is_floating_point():
        raise ValueError(f"token_step must be an integer (B, T) tensor with B = P*G = {P * G}, "
                         f"got {token_step.dtype} {tuple(token_step.shape)}")
    if not bool(torch.isfinite(step_scores).all()):
        raise ValueError("step_scores contain NaN or inf")
    return PROCESS_DELTAS[mode](step_scores, step_mask, token_step)


def step_mismatch(step_mask: Tensor, token_step: Tensor) -> Tensor:
    """(B,) bool: rows whose reward scored a different number of steps than the tokens cover.

    Such a row's extra scores are dropped and its unscored tokens get Δ = 0; a row whose reward
    failed (no steps) counts here too. Log the fraction: it should be 0.
    """
    scored = step_mask.reshape(token_step.shape[0], -1).sum(-1)  # (B,)
    covered = token_step.amax(dim=1).clamp(min=-1) + 1  # (B,) steps 0..max
    return scored != covered


def _center_steps(x: Tensor, step_mask: Tensor) -> Tensor:
    """(P, G, S) -> x minus the mean over the group's responses that have step s; 0 where they agree."""
    zero = torch.zeros_like(x)
    count = step_mask.sum(dim=1, keepdim=True).clamp(min=1).to(x.dtype)  # (P, 1, S)
    mean = torch.where(step_mask, x, zero).sum(dim=1, keepdim=True) / count  # (P, 1, S)
    hi = torch.where(step_mask, x, torch.full_like(x, -math.inf)).amax(dim=1, keepdim=True)  # (P, 1, S)
    lo = torch.where(step_mask, x, torch.full_like(x, math.inf)).amin(dim=1, keepdim=True)  # (P, 1, S)
    return torch.where(step_mask & (hi != lo), x - mean, zero)


def _broadcast_steps(delta_steps: Tensor, step_mask: Tensor, token_step: Tensor) -> Tensor:
    """(P, G, S) per-step Δ -> (B, T): each token takes its step's Δ; 0 for no step or an unscored one."""
    P, G, S = delta_steps.shape
    d = delta_steps.reshape(P * G, S)  # (B, S)
    valid = (token_step >= 0) & (token_step < S)  # (B, T)
    idx = token_step.clamp(0, S - 1).long()  # (B, T)
    valid = valid & step_mask.reshape(P * G, S).gather(1, idx)
    return torch.where(valid, d.gather(1, idx), torch.zeros((), dtype=d.dtype))


def _zero_agreeing(delta: Tensor, rewards: Tensor) -> Tensor:
    """Set Δ to exactly 0 in groups whose rewards all agree (the mean of equal floats can be off by an ulp)."""
    return torch.where(agreeing_groups(rewards)[:, None], torch.zeros_like(delta), delta)
