"""The rollout stage: sample, score, Δ, logp_old, logp_ref. No gradient anywhere here.

Sampling and scoring go through rlvr.groups.sample_and_score (the one path from prompts to scored
responses, shared with evaluation and the probe). `rollout(...)` is steps 1-5 of a training step
and returns a `Batch` that carries everything the learn stage needs, plus the version of the
policy that sampled it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import torch

from rlvr import advantages, costs, logprobs, losses, sampling, scoring
from rlvr.groups import (  # noqa: F401  (score_groups, total_overflow: the callers' names)
    Groups,
    merge,
    sample_and_score,
    score_groups,
    total_overflow,
)
from rlvr.policy import Policy, Tokenizer
from rlvr.rewards import steps_of
from rlvr.setup_types import RunError, logp_old_in_learn
from rlvr.value import LearnedBaseline


@dataclass
class Batch:
    """One step's rollouts, scored, with everything the learn stage needs (all detached)."""

    groups: Groups
    """The groups trained on (after dynamic sampling dropped agreeing ones)."""
    parts: list[Groups]
    """Every sampling round of the step, kept or not (all are paid for)."""
    delta: torch.Tensor                # (P', G)
    """One Δ per response (for a process reward: the mean of its tokens' Δ; logged, see delta_tokens)."""
    logp_old: torch.Tensor             # (B, T) under the distribution sampled from
    """The ratio's denominator: the sampler's log-probs, or (algorithm.logp_old = recompute, or a
    stale batch corrected by rlvr.distributed.staleness) the learner's forward's (`training_logprobs`);
    see logp_old_version."""
    logp_ref: torch.Tensor | None      # (B, T) under the reference (tempered, no nucleus), when the KL term is on
    version: int
    """Policy version that sampled these rows (number of updates applied before sampling)."""
    sample_s: float = 0.0
    cost: dict = field(default_factory=dict)
    """Tokens and FLOPs this stage computed: sampled_tokens, forward_tokens, flops."""
    delta_tokens: torch.Tensor | None = None
    """(B, T) per-token Δ, when Δ differs along a response (process rewards, KL in the reward);
    the learn stage then uses it instead of `delta`. 0 off the response mask."""
    stats: dict = field(default_factory=dict)
    """Figures of this stage for the step's row (logged as train/<name>): value_loss and
    baseline_mean, step_mismatch_frac, kl_in_reward (the sequence k1 charged in the reward);
    nonzero_delta_frac when Δ is per token; with algorithm.logp_old = recompute
    sampler_logp_absdiff and the IS weight's sampler_is_weight_mean / _max, sampler_is_truncated_frac,
    sampler_behav_ratio_min / _max. (The overlong penalty is in groups.per_reward.)"""
    logp_old_version: int | None = None
    """The policy version whose training forward (`training_logprobs`) gave `logp_old` (the weights when it was
    computed); None: `logp_old` is the sampler's own, from version `version`."""
    loss_mask: torch.Tensor | None = None
    """(B, T) the tokens the loss reads, where fewer than the response mask (algorithm.mask_truncated:
    0 on rows cut at the length bound); None: `rollout.mask`."""
    score_s: float = 0.0
    """Seconds this process spent scoring the step's responses (every sampling round's
    `Groups.score_s`); 0 where rollout workers sampled and scored them (side by side, in their own
    processes)."""
    logp_old_pending: bool = False
    """`logp_old` is still the sampler's, and the learn stage's forwards at π_old give the learner's
    (rlvr.setup_types.logp_old_in_learn) with Δ times min(π_train / π_sampler, is_cap) (rlvr.learn.minibatch_loss,
    and rlvr.learn.prepass_logp_old for the minibatches after the first)."""

    @property
    def train_mask(self) -> torch.Tensor:
        """(B, T) the tokens the learn stage's loss terms and their denominators read."""
        return self.rollout.mask if self.loss_mask is None else self.loss_mask

    @property
    def rollout(self) -> sampling.Rollout:
        return self.groups.rollout

    @property
    def delta_rows(self) -> torch.Tensor:
        """What the learn stage weighs ∇logp by: (B, T) `delta_tokens` when set, else (B,) `delta`."""
        return self.delta_tokens if self.delta_tokens is not None else self.delta.reshape(-1)


def dynamic_sample(sample, draw, P: int, G: int, rounds: int, pad_id: int) -> tuple[Groups, list[Groups]]:
    """DAPO's dynamic sampling: drop groups whose rewards all agree (their Δ is 0) and sample
    `sample(draw())` again until P groups remain or `rounds` rounds were sampled. Returns the batch
    and every round sampled (all of them are paid for). With no group left, the batch is the first round."""
    parts = [sample(draw())]
    kept = []
    while True:
        last = parts[-1]
        useful = torch.nonzero(~advantages.agreeing_groups(last.rewards)).view(-1)
        if len(useful):
            kept.append(last.select(useful, G))
        if sum(len(k.examples) for k in kept) >= P or len(parts) >= rounds:
            break
        parts.append(sample(draw()))
    if not kept:
        return parts[0], parts
    batch = merge(kept, pad_id)
    return batch.select(torch.arange(min(P, len(batch.examples))), G), parts


def reference_logprobs(policy: Policy, reference: Policy | None, rollout: sampling.Rollout, *, temperature: float,
                       chunk_rows: int | None, group_size: int | None,
                       autocast=contextlib.nullcontext, buckets: bool = False) -> torch.Tensor:
    """(B, T) logp_ref: a frozen copy `reference`, or (None) the policy with its adapter disabled,
    under the training numerics `autocast()` (so the KL is 0 at π = π_ref); `buckets`: in length
    buckets (train.length_buckets, rlvr.scoring.length_buckets).

    Scored without a nucleus: a token outside π_ref's own nucleus would get the floor log-prob and
    a huge, meaningless KL (see rlvr.scoring.OUTSIDE_NUCLEUS_LOGP)."""
    with torch.no_grad(), (policy.adapter_disabled() if reference is None else contextlib.nullcontext()), autocast():
        return scoring.sequence_token_logprobs(reference if reference is not None else policy, rollout,
                                                temperature=temperature, top_p=1.0, top_k=0, min_p=0.0,
                                                chunk_rows=chunk_rows,
                                                group_size=group_size, buckets=buckets)


def sample_rounds(setup, policy: Policy, examples_fn, *, generator: torch.Generator, pool=None,
                  sampler=None) -> tuple[Groups, list[Groups]]:
    """Steps 1-2 of `rollout`: the step's groups and every sampling round it took (dynamic sampling's
    refills included, all of them paid for), each sampled and scored in this process
    (`sample_and_score`) or by `sampler`, with DAPO's overlong penalty added (`algorithm.overlong_buffer`)."""
    cfg, tok = setup.cfg, setup.tokenizer
    sc, ac, tc = cfg.sampling, cfg.algorithm, cfg.train
    G = tc.samples_per_prompt

    def sample(examples: list) -> Groups:
        if sampler is not None:  # rlvr.distributed: sampled and scored by rollout workers
            got = sampler(examples)
        else:
            got = sample_and_score(policy, tok, setup.task, examples, G=G, limits=setup.limits,
                                   weights=setup.reward_weights, temperature=sc.temperature, top_p=sc.top_p,
                                   top_k=sc.top_k, min_p=sc.min_p, generator=generator, pool=pool,
                                   autocast=setup.numerics.context)
        return add_overlong_penalty(got, ac, setup.limits.max_new_tokens) if ac.overlong_buffer else got

    if ac.dynamic_sampling:
        return dynamic_sample(sample, examples_fn, tc.prompts_per_step, G, ac.dynamic_sampling_rounds, tok.pad_id)
    groups = sample(examples_fn())
    return groups, [groups]


def sampling_cost(parts: list[Groups], fwd_flops: float) -> dict:
    """Tokens and FLOPs the sampling rounds `parts` computed (every round is paid for, kept or not):
    sampled_tokens, forward_tokens (with tool calls, the tool loop's own count) and flops at
    `fwd_flops` per forward token."""
    cost = {"sampled_tokens": 0, "forward_tokens": 0, "flops": 0.0}
    for p in parts:
        n_fwd = p.tools.forward_tokens if p.tools is not None else sampled_positions(p.rollout, len(p.examples))
        cost["sampled_tokens"] += int(p.rollout.mask.sum())
        charge_forward(cost, n_fwd, fwd_flops)
    return cost


def charge_forward(cost: dict, n_tok: int, fwd_flops: float) -> None:
    """Add a forward over `n_tok` token positions to `cost` (forward_tokens, and flops at `fwd_flops` a token)."""
    cost["forward_tokens"] += n_tok
    cost["flops"] += n_tok * fwd_flops


def rollout(setup, policy: Policy, reference: Policy | None, examples_fn, *, version: int,
            generator: torch.Generator, pool=None, value: LearnedBaseline | None = None,
            sampler=None, policy_version: int | None = None) -> Batch:
    """The rollout stage of a training step (the trainer's steps 1-5), no gradient on the policy:

    1. sample P prompts (`examples_fn()`), G responses each from π_old (the current weights);
    2. score them (failures counted, never fatal); DAPO's overlong penalty is added to the rewards
       right here (`algorithm.overlong_buffer`), so every later use sees the shaped reward;
    3. logp_old: the sampler's own log-probs, detached (no second forward, no copy of π_old);
    4. logp_ref under the reference when the KL term is on (`reference`, or the adapter-off policy);
    5. Δ (`batch_delta`): the scheme on the (P, G) rewards (`learned`: R - V(S) with `value`, read
       before its own update), per-token Δ from a process reward's per-step scores, and with
       kl_in = "reward" the KL folded into a per-token Δ;
    6. algorithm.logp_old = "recompute" (or `auto` with bf16 forwards, rlvr.setup_types.logp_old_source):
       where rlvr.setup_types.logp_old_in_learn says so the learn stage's forwards give it (`logp_old_pending`);
       else logp_old from the learner's forward of `policy`
       (`training_logprobs`; run before step 5, whose KL in the reward then reads it), and Δ per
       token times the truncated IS weight min(π_train / π_sampler, is_cap) (`recompute_logp_old`).

    Every forward runs under the run's numerics (`setup.numerics`, model.autocast).
    `sampler(examples) -> Groups` replaces step 1-2's in-process sampling and scoring (rlvr.distributed:
    rollout workers). `policy_version`: the version of `policy`'s weights now (default `version`;
    newer when the rows were sampled ahead by rollout workers).
    """
    cfg = setup.cfg
    sc, ac, G = cfg.sampling, cfg.algorithm, cfg.train.samples_per_prompt
    t0 = time.perf_counter()
    policy.eval()
    groups, parts = sample_rounds(setup, policy, examples_fn, generator=generator, pool=pool, sampler=sampler)
    sample_s = time.perf_counter() - t0
    fwd_flops, _ = costs.model_flops_per_token(policy, setup.limits.prompt_tokens, setup.limits.max_new_tokens)
    cost = sampling_cost(parts, fwd_flops)

    logp_old = groups.rollout.logp.detach()                                           # (B, T)
    logp_ref = None
    shared = cfg.model.share_prompt_forward and policy.differentiable_cache
    if ac.kl_coef > 0:
        logp_ref = reference_logprobs(policy, reference, groups.rollout, temperature=sc.temperature,
                                      chunk_rows=logprobs.chunk_setting(cfg.model.logprob_chunk_rows),
                                      group_size=G if cfg.model.share_prompt_forward else None,
                                      autocast=setup.numerics.context, buckets=cfg.train.length_buckets)
        charge_forward(cost, forward_tokens(groups.rollout, G, shared, cfg.train.length_buckets), fwd_flops)
    recompute, pick = setup.recompute_logp_old, ac.top_entropy_quantile < 1
    in_learn = recompute and logp_old_in_learn(cfg) and (policy_version is None or policy_version == version)
    recompute = recompute and not in_learn            # the learn stage's first forward gives it (no extra one)
    train_fwd = None
    if recompute or pick:  # one training forward (no backward) serves both; before Δ: kl_in = "reward" reads it
        train_fwd = training_logprobs(policy, groups.rollout, cfg, setup.numerics.context,
                                      full=recompute and ac.kl_in == "reward" and logp_ref is not None, entropy=pick)
        tc = cfg.train
        in_parts = micro_rows(torch.arange(groups.rollout.ids.size(0)), G, tc.minibatches * tc.micro_batches,
                              groups.rollout.mask if tc.length_buckets else None)   # training_logprobs' parts
        charge_forward(cost, forward_tokens(groups.rollout, G, shared, tc.length_buckets, in_parts), fwd_flops)
    delta, delta_tokens, stats = batch_delta(setup, groups, logp_ref, value,
                                             logp_full=train_fwd.logp_full if recompute else None)
    # the share of the decode forwards' rows spent on rows that had already ended (rlvr.sampling.COMPACT_FINISHED)
    decode_rows = sum(p.rollout.decode_rows for p in parts)
    stats["decode_finished_row_frac"] = sum(p.rollout.decode_finished_rows for p in parts) / max(1, decode_rows)
    batch = Batch(groups, parts, delta, logp_old, logp_ref, version, sample_s, cost, delta_tokens, stats,
                  logp_old_pending=in_learn, score_s=0.0 if sampler is not None else sum(p.score_s for p in parts))
    if recompute:
        batch = recompute_logp_old(setup, policy, batch, version if policy_version is None else policy_version,
                                   logp_train=train_fwd.logp)
    if pick:
        batch = high_entropy_delta(batch, train_fwd.entropy, ac.top_entropy_quantile)
    if ac.mask_truncated:
        batch = mask_truncated(batch)
    return batch


def entropy_threshold(entropy: torch.Tensor, frac: float) -> torch.Tensor:
    """The (1 - frac) quantile of `entropy` (n,), linearly interpolated between the two nearest values
    as torch.quantile (and so TRL) takes it; by sorting, which has no limit on n."""
    v = entropy.float().sort().values
    pos = (1.0 - frac) * (v.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, v.numel() - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def high_entropy_delta(batch: Batch, entropy: torch.Tensor, frac: float) -> Batch:
    """algorithm.top_entropy_quantile = `frac` < 1: `batch` with Δ per token kept on the generated tokens
    whose entropy under π_old (`entropy` (B, T), from the training forward) is at least the batch's
    (1 - frac) quantile (`entropy_threshold`) and 0 on the others. Their KL and entropy terms and
    the denominators are untouched: only the policy-gradient term loses them. Adds high_entropy_frac
    (the fraction of generated tokens kept) and entropy_threshold to the batch's figures."""
    mask = batch.rollout.mask.bool()                                              # (B, T)
    if not mask.any():
        return batch
    thr = entropy_threshold(entropy[mask], frac)
    keep = mask & (entropy >= thr)                                                # (B, T)
    d = batch.delta_rows.to(entropy.device)
    tokens = (d.unsqueeze(1) if d.dim() == 1 else d) * keep.to(d.dtype)           # (B, T)
    stats = {**batch.stats, "high_entropy_frac": float(keep.sum() / mask.sum()), "entropy_threshold": float(thr)}
    return dataclasses.replace(batch, delta_tokens=tokens, stats=stats)


def mask_truncated(batch: Batch) -> Batch:
    """algorithm.mask_truncated: `batch` whose loss reads no token of a row cut at the length bound
    (`loss_mask` 0 there), with the fraction of such rows as masked_truncated_frac."""
    cut = batch.rollout.truncated.to(batch.rollout.mask.device)                   # (B,)
    loss_mask = batch.rollout.mask * (~cut).unsqueeze(1).to(batch.rollout.mask.dtype)
    return dataclasses.replace(batch, loss_mask=loss_mask,
                               stats={**batch.stats, "masked_truncated_frac": float(cut.float().mean())})


def micro_rows(rows: torch.Tensor, G: int, parts: int, mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """`rows` (whole groups of G, in order) as at most `parts` runs of whole groups, in order; with
    `mask` (the batch's (B, T) response mask: train.length_buckets) the groups first sorted by their
    longest response, longest first (`length_sorted`), so each run holds groups of similar lengths."""
    if mask is not None and parts > 1:
        rows = length_sorted(rows, G, mask)
    groups = rows.view(-1, G)
    return [g.reshape(-1) for g in groups.chunk(min(parts, groups.size(0)))]


def length_sorted(rows: torch.Tensor, G: int, mask: torch.Tensor) -> torch.Tensor:
    """`rows` (whole groups of G) reordered group by group by the group's longest response (the
    columns a forward over it reaches, rlvr.scoring.response_extent of `mask` (B, T)), longest
    first; a stable sort (equal lengths keep their order), a group's rows in their own order."""
    groups = rows.view(-1, G)                                                           # (n, G)
    extent = scoring.response_extent(mask[rows.to(mask.device)]).view(-1, G).amax(1)  # (n,)
    order = torch.sort(extent.cpu(), descending=True, stable=True).indices.to(rows.device)
    return groups[order].reshape(-1)


def training_logprobs(policy: Policy, rollout: sampling.Rollout, cfg, autocast=contextlib.nullcontext,
                      full: bool = False, entropy: bool = False) -> scoring.TokenLogprobs:
    """(logp, logp_full, entropy or None), each (B, T) and detached: the forward the learn stage runs
    on these rows, under the training numerics `autocast()`, scored under the sampling distribution
    (the tempered nucleus) and, with `full` and a nucleus (top_p, top_k or min_p), also under the
    tempered distribution without it (the KL's side; else `logp` serves as both: equal without
    truncation); with `entropy` the per-token entropy of the tempered distribution without the nucleus.

    The learn stage's forward is matched, not only its numerics: the forward runs with gradient
    enabled (its graph is dropped at once; nothing is kept for a backward) and the policy in training
    mode (no dropout but a LoRA's own; `train.gradient_checkpointing` applies), over the same parts
    of rows the learner's first pass takes with train.minibatches = 1 (`micro_rows`: the
    train.micro_batches runs of whole groups, in order or, with train.length_buckets, sorted by length),
    so at most one part's activations are alive.
    A no-gradient forward takes other products (the bf16 weight copies stacked for decoding, the
    head in blocks): on SmolLM2-135M under CPU bf16 autocast it gave the sampler's log-probs, 0.0105
    mean (0.30 largest) away from the learner's, and a forward over half the rows was 0.028 away, so
    logp_old from anything else leaves the first minibatch's ratio off 1 by bf16 noise. Where it
    serves (rlvr.setup_types.logp_old_in_learn says no) the learner's parts may still differ, so the ratio
    starts at 1 to bf16 rounding only there; otherwise the learn stage computes logp_old itself
    (rlvr.learn.prepass_logp_old)."""
    sc, tc, G = cfg.sampling, cfg.train, cfg.train.samples_per_prompt
    kw = dict(temperature=sc.temperature, top_p=sc.top_p, top_k=sc.top_k, min_p=sc.min_p,
              chunk_rows=logprobs.chunk_setting(cfg.model.logprob_chunk_rows),
              group_size=G if cfg.model.share_prompt_forward else None, buckets=tc.length_buckets)
    full = full and sampling.truncates(sc.top_p, sc.top_k, sc.min_p)
    was_training = policy.training
    policy.train(cfg.model.lora_dropout == 0)          # as the learner's forward, but never a LoRA dropout
    parts = micro_rows(torch.arange(rollout.ids.size(0)), G, tc.minibatches * tc.micro_batches,
                       rollout.mask if tc.length_buckets else None)
    got: list[scoring.TokenLogprobs] = []
    try:
        for rows in parts:
            sub = rollout if len(parts) == 1 else rollout.select(rows.to(rollout.ids.device))
            with torch.enable_grad(), autocast():
                out = scoring.sequence_token_logprobs(policy, sub, return_full=full, return_entropy=entropy, **kw)
            if isinstance(out, torch.Tensor):                                         # (b, T)
                out = scoring.TokenLogprobs(out, None, None)
            got.append(scoring.TokenLogprobs(*(None if x is None else x.detach() for x in out)))
    finally:
        policy.train(was_training)
    order = torch.cat(parts).to(rollout.ids.device)        # the rows in the parts' order (length_buckets)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    cat = (lambda xs: None if xs[0] is None else xs[0] if len(xs) == 1 else torch.cat(xs)[back])
    logp = cat([g.logp for g in got])
    return scoring.TokenLogprobs(logp, cat([g.logp_full for g in got]) if full else logp,
                                  cat([g.entropy for g in got]))


@torch.no_grad()
def off_policy_correction(policy: Policy, batch: Batch, cfg, cap: float, autocast=contextlib.nullcontext,
                          logp_old: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(logp_old (B, T), Δ·w (B, T), the weight's figures) to learn `batch` from the current weights of
    `policy` when its rows were drawn from another distribution π_behav (`batch.logp_old`):

        logp_old = log π_old(y_t)    the learner's forward under `autocast()` (`training_logprobs`)
        w_t      = min(π_old(y_t) / π_behav(y_t), cap)       (rlvr.losses.truncated_is_weight)
        Δ_t      = batch.delta_rows (per row or per token) · w_t

    The one correction behind algorithm.logp_old = recompute (π_behav = the sampler's numerics) and
    the staleness correction (π_behav = an older policy's sampler, rlvr.distributed.staleness).
    Off the response mask w = 1 and Δ is left as it was (the loss never reads it there). `logp_old`:
    that forward's log-probs when already computed (`training_logprobs`); then none is run."""
    if logp_old is None:
        logp_old = training_logprobs(policy, batch.rollout, cfg, autocast).logp            # (B, T)
    w, stats = losses.truncated_is_weight(logp_old, batch.logp_old, batch.rollout.mask, cap)
    d = batch.delta_rows.to(w.device)                                         # (B,) or (B, T)
    return logp_old.detach(), (d.unsqueeze(1) if d.dim() == 1 else d) * w, stats


def recompute_logp_old(setup, policy: Policy, batch: Batch, policy_version: int,
                       logp_train: torch.Tensor | None = None) -> Batch:
    """algorithm.logp_old = "recompute": `batch` with logp_old from the learner's forward of `policy` (version
    `policy_version`) under the run's training numerics, and delta_tokens = Δ · min(π_train / π_sampler,
    algorithm.is_cap) per token (0 off the mask) (`off_policy_correction`). The first minibatch of the
    update then sees ratio exactly 1, and the tokens the sampler under-weighted are weighted up.

    Adds to the batch's figures sampler_logp_absdiff = mean |logp_sampler - logp_train| over generated
    tokens, and the weight's figures as sampler_is_weight_mean / _max, sampler_is_truncated_frac,
    sampler_behav_ratio_min / _max. On rows sampled ahead by older weights (rlvr.distributed) the one
    weight covers their staleness too (π_train is the current policy). `logp_train`: that forward's
    log-probs when the rollout stage already ran it (`training_logprobs`)."""
    mask = batch.rollout.mask                                                 # (B, T)
    logp_train, delta_w, w_stats = off_policy_correction(policy, batch, setup.cfg, setup.cfg.algorithm.is_cap,
                                                         setup.numerics.context, logp_old=logp_train)
    m = mask.bool()
    absdiff = float((logp_train - batch.logp_old).abs()[m].mean()) if m.any() else 0.0
    stats = {**batch.stats, "sampler_logp_absdiff": absdiff, **{f"sampler_{k}": v for k, v in w_stats.items()}}
    return dataclasses.replace(batch, logp_old=logp_train, delta_tokens=delta_w * mask.to(delta_w.dtype),
                               stats=stats, logp_old_version=policy_version)


OVERLONG = "overlong_penalty"
"""The name the overlong penalty is kept under in `Groups.per_reward` (logged as train/reward_overlong_penalty)."""


def add_overlong_penalty(groups: Groups, ac, max_len: int) -> Groups:
    """`groups` with DAPO's soft overlong penalty (rlvr.advantages.overlong_penalty) added to each
    response's reward: 0 up to max_len - overlong_buffer tokens, then a linear ramp down to
    -overlong_penalty at max_len. Kept per response in `per_reward[OVERLONG]`."""
    pen = advantages.overlong_penalty(groups.rollout.response_lengths.cpu(), max_len, ac.overlong_buffer,
                                      ac.overlong_penalty).to(groups.rewards.dtype)              # (B,)
    return dataclasses.replace(groups, rewards=groups.rewards + pen.view_as(groups.rewards),
                               per_reward={**groups.per_reward, OVERLONG: pen.tolist()})


def batch_delta(setup, groups: Groups, logp_ref: torch.Tensor | None, value: LearnedBaseline | None,
                logp_full: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """(P, G) Δ, the (B, T) per-token Δ or None, and this stage's figures, in this order:

    1. process rewards (a reward whose values carry per-step scores, rlvr.rewards.steps_of): their
       weighted steps give a per-token Δ (`algorithm.process_delta`), and the scheme sees only the
       rest of the reward (the other rewards and the overlong penalty);
    2. the scheme on the (P, G) rewards; `learned`: b = V(S) read first, Δ = R - b, then V's own
       squared-error step on these rewards (so b never depends on the rewards it is subtracted from);
    3. kl_in = "reward": Δ[b, t] -= kl_coef · Σ_{t' >= t} (logp_full - logp_ref)[b, t'] (k1 return to go,
       both sides under the tempered distribution without the nucleus). `logp_full` (B, T): the
       policy's side from the training forward of algorithm.logp_old = recompute (the numerics
       logp_ref is computed in, so the KL is 0 where π = π_ref, as verl charges it on the actor's
       recomputed log-probs); without it the sampler's own (`Rollout.tempered_logp`).
    """
    ac, G, stats = setup.cfg.algorithm, setup.cfg.train.samples_per_prompt, {}
    mask = groups.rollout.mask                                                          # (B, T)
    process, plain = process_token_delta(setup, groups, stats)                          # (B, T) | None, (P, G)
    if ac.scheme == "learned":
        delta = learned_delta(value, groups.rollout, plain, G, ac.top_k or None, stats)
    else:
        delta = advantages.compute(plain, ac.scheme, top_k=ac.top_k or None)            # (P, G)
    tokens = None
    if process is not None:
        tokens = torch.where(mask.cpu().bool(), process + delta.reshape(-1, 1), torch.zeros((), dtype=process.dtype))
        n = mask.cpu().sum(1).clamp(min=1)
        stats["nonzero_delta_frac"] = float((tokens != 0).any(1).float().mean())
        delta = (tokens.sum(1) / n).view_as(delta)                                      # logged per response
    if ac.kl_in == "reward" and logp_ref is not None:
        base = (tokens if tokens is not None else delta.reshape(-1)).to(mask.device)
        logp_full = groups.rollout.tempered_logp if logp_full is None else logp_full.to(mask.device)
        tokens = advantages.kl_reward_delta(base, logp_full, logp_ref, mask, ac.kl_coef)  # (B, T)
        stats["kl_in_reward"] = float(((logp_full - logp_ref) * mask).sum(1).mean())
    return delta, tokens, stats


def learned_delta(value: LearnedBaseline | None, roll: sampling.Rollout, rewards: torch.Tensor, G: int,
                  top_k: int | None, stats: dict) -> torch.Tensor:
    """Δ = R - V(S) (P, G) with the critic read BEFORE its update on these rewards; logs
    value_loss (before the step) and baseline_mean."""
    if value is None:
        raise ValueError("algorithm.scheme = 'learned' needs the run's LearnedBaseline (rollout(value=...))")
    prompt_ids, prompt_mask = roll.prompt_ids[::G], roll.attention_mask[::G, :roll.prompt_len]   # (P, Lp)
    b = value.baseline(prompt_ids, prompt_mask).to(rewards.device)                    # (P,)
    delta = advantages.compute(rewards, "baseline", baseline=b.to(rewards.dtype), top_k=top_k)
    stats["value_loss"] = value.update(prompt_ids, prompt_mask, rewards)
    stats["baseline_mean"] = float(b.mean())
    return delta


def process_token_delta(setup, groups: Groups, stats: dict) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Per-token Δ (B, T) of the run's process rewards (None when no reward returned steps) and the
    (P, G) rewards left for the scheme (the total minus each process reward's weighted mean).

    Σ over process rewards n of w_n · process_delta(steps_n) (rlvr.advantages.PROCESS_DELTAS), steps
    located in the response text by the task's step_delimiter; logs step_mismatch_frac, the share
    of rows whose scored steps do not match their tokens (should be 0). In an environment task the
    steps are the episode's actions (their token spans, rlvr.advantages.span_steps): a per-turn reward
    (rlvr.environments.turn_rewards) credits the tokens of its own action."""
    names = [n for n in setup.reward_weights if any(steps_of(v) for v in groups.per_reward.get(n, ()))]
    if not names:
        return None, groups.rewards
    roll, G, ac = groups.rollout, setup.cfg.train.samples_per_prompt, setup.cfg.algorithm
    if G < 2:  # centred across a group of one, every step's Δ would be 0: nothing would be learned from them
        raise RunError(f"task.reward: {', '.join(names)} returned per-step scores (a process reward), whose "
                       f"per-token Δ is centred across a prompt's samples; train.samples_per_prompt = 1 makes it "
                       f"0 for every token. Use train.samples_per_prompt >= 2 (algorithm.process_delta = "
                       f"{ac.process_delta})")
    B, T = roll.mask.shape
    if setup.task.environment is not None:   # the steps are the episode's actions (rlvr.environments)
        token_step = advantages.span_steps([getattr(r, "spans", ()) for r in groups.responses], T)   # (B, T)
    else:
        token_step = advantages.token_steps(token_texts(setup.tokenizer, roll, setup.limits.eos_id is not None),
                                            setup.task.step_delimiter, T)              # (B, T)
    process = torch.zeros(B, T)
    plain = groups.rewards.clone()
    mismatch = torch.zeros(B, dtype=torch.bool)
    for n in names:
        w = float(setup.reward_weights[n])
        scores, step_mask = advantages.pad_steps([steps_of(v) for v in groups.per_reward[n]], G)  # (P, G, S)
        process += w * advantages.process_delta(scores, step_mask, token_step, ac.process_delta).float()
        plain -= w * torch.tensor([float(v) for v in groups.per_reward[n]], dtype=plain.dtype).view_as(plain)
        mismatch |= advantages.step_mismatch(step_mask, token_step)
    stats["step_mismatch_frac"] = float(mismatch.float().mean())
    return process, plain


def token_texts(tok: Tokenizer, roll: sampling.Rollout, stop_at_eos: bool) -> list[list[str]]:
    """Per row, the text each generated token adds to the decoded response (a special adds ""), so
    that their concatenation is the text the reward scored. Decoded prefix by prefix (a token's
    text can depend on its neighbours under byte-level BPE): O(T²) decoding per row, paid only by
    runs with a process reward."""
    out = []
    for row, n in zip(roll.response_ids.tolist(), roll.response_lengths.tolist()):
        texts, prev = [], ""
        for t in range(n):
            cur = tok.decode(row[:t + 1], stop_at_eos=stop_at_eos)
            texts.append(cur[len(prev):])
            prev = cur
        out.append(texts)
    return out


def forward_tokens(rollout: sampling.Rollout, G: int, shared_prompt: bool, buckets: bool = False,
                   parts: list[torch.Tensor] | None = None) -> int:
    """Token positions log-prob forwards over `rollout` compute: each of `parts` (row indices, whole
    groups; None: every row in one forward) runs its rows' prompts (each prompt once with
    `shared_prompt`) and their responses but the last token, to the part's longest row, or with
    `buckets` (train.length_buckets) each length bucket to its own longest
    (rlvr.scoring.bucket_positions). Where every row runs to the mask's width this is
    rlvr.costs.logp_forward_tokens, the price's count at the cap."""
    ext = scoring.response_extent(rollout.mask)                                       # (B,)
    n = 0
    for p in [None] if parts is None else parts:
        e = ext if p is None else ext[p.to(ext.device)]
        rows = e.numel()
        cols, _ = scoring.bucket_positions(e, buckets)
        n += (rows // G if shared_prompt else rows) * rollout.prompt_len + cols - rows
    return n


def sampled_positions(rollout: sampling.Rollout, prompts: int) -> int:
    """Token positions a sampling call over `prompts` prompts computed: each prompt once (prefill),
    then the rows each decode step computed (`Rollout.decode_rows`: finished rows that left the batch
    not counted). A rollout that does not say (decode_rows 0 over more than one column): every row
    but its last token (rlvr.costs.sampling_forward_tokens, the price's count at the cap)."""
    B, T = rollout.mask.shape
    if rollout.decode_rows or T <= 1:
        return prompts * rollout.prompt_len + rollout.decode_rows
    return costs.sampling_forward_tokens(prompts, rollout.prompt_len, B, T)
