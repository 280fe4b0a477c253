"""The learn stage: μ passes of minibatch updates on one rollout batch (steps 6-7 of a step).

`learn(...)` is pure given its inputs: the policy and its optimizer and scheduler are updated,
nothing else is read or written. The minibatch order comes from its own generator, so where and
how the batch was sampled cannot change the learner's random stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
from dataclasses import dataclass
from typing import Callable

import torch

from rlvr import config as config_mod, logprobs, losses, optim, sampling, scoring
from rlvr.lengths import length_survival, part_lengths
from rlvr.policy import Policy
from rlvr.rollout import Batch, forward_tokens, micro_rows
from rlvr.scoring import bucket_positions, response_extent
from rlvr.machine import ordered_pair, time_calls
from rlvr.probes import learn_probe_share
from rlvr.procmem import ResidentPeak
from rlvr.setup_types import Setup


def lr_at(cfg: config_mod.TrainConfig, opt_step: int, total: int) -> float:
    """Learning-rate multiplier at optimizer step `opt_step` (0-based) of `total`.

    Linear warm-up over `warmup_steps` ((s + 1) / warmup), then `constant` (1), `cosine`
    (0.1 + 0.9 · ½(1 + cos(π f))) or `linear` (1 − 0.9 f), f = (s − warmup) / (total − warmup):
    both decays end at 10% of `train.lr`."""
    if cfg.warmup_steps and opt_step < cfg.warmup_steps:
        return (opt_step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    frac = (opt_step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    if cfg.lr_schedule == "cosine":
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return 1.0 - 0.9 * min(1.0, frac)


def make_optimizer(params: list, tc: config_mod.TrainConfig) -> torch.optim.Optimizer:
    """AdamW; its fused kernel when this torch has one for the device (same update, one kernel per
    step instead of a loop over tensors); over one flat buffer (rlvr.optim.FlatAdamW, the same update
    bit for bit) when the parameters are many small CPU tensors that allow it: one pass instead of
    one per tensor (figures: docs/benchmarks.md)."""
    kw = dict(lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)
    try:
        if optim.flat_fits(params):
            return optim.FlatAdamW(params, **kw)
        return torch.optim.AdamW(params, fused=True, **kw)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, **kw)


def make_scheduler(opt: torch.optim.Optimizer, tc: config_mod.TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_at` laid out over every optimizer step of the run (steps × μ × minibatches)."""
    total = tc.steps * tc.epochs_per_batch * tc.minibatches
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(tc, s, total))


@dataclass
class Learner:
    """What the learn stage updates and reads: the policy, its optimizer and schedule, the config,
    and the generator that orders minibatches."""

    policy: Policy
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    cfg: config_mod.Config
    generator: torch.Generator
    max_len: int
    """The response bound (`seq_sum_const` divides by it)."""
    flops: tuple[int, int] = (0, 0)
    """(forward, training) FLOPs per token at the run's lengths (rlvr.costs.model_flops_per_token)."""
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """The training numerics: a new context per call that the training forward runs in
    (rlvr.numerics.Numerics.context: bf16 autocast, or nothing); the backward runs outside it."""
    row_buckets: bool = True
    """Whether a training forward may split its rows into length buckets (train.length_buckets,
    rlvr.scoring.length_buckets): off on a rank of a learner group, whose forwards are collectives
    that every rank must run as often as the others."""


def minibatch_rows(learner: Learner, n_groups: int, G: int) -> list[torch.Tensor]:
    """Row indices of each minibatch of one epoch: whole groups (a prompt's G rows stay together),
    shuffled by the learner's generator when there is more than one minibatch."""
    tc, gen = learner.cfg.train, learner.generator
    order = (torch.randperm(n_groups, generator=gen, device=gen.device) if tc.minibatches > 1
             else torch.arange(n_groups, device=gen.device))
    return [(g[:, None] * G + torch.arange(G, device=gen.device)).reshape(-1) for g in order.chunk(tc.minibatches)]


def part_rows(learner: Learner, batch: Batch, rows: torch.Tensor) -> list[torch.Tensor]:
    """The `train.micro_batches` parts of whole groups that `rows` (one minibatch, or a rank's share
    of it) are forwarded and back-propagated in (rlvr.rollout.micro_rows): in order, or with
    `train.length_buckets` sorted by their longest response first, so a part's forward, which stops at
    its own longest row (rlvr.scoring.sequence_token_logprobs), computes less padding. Every pass
    over the rows takes these parts (`accumulate`, `prepass_logp_old`)."""
    tc = learner.cfg.train
    return micro_rows(rows, tc.samples_per_prompt, tc.micro_batches,
                      batch.rollout.mask if tc.length_buckets else None)


def padding_positions(mask: torch.Tensor, parts: list[torch.Tensor], buckets: bool = False) -> tuple[int, int]:
    """(response positions the forwards over `parts` compute, of them padding) for the response mask
    `mask` (B, T): a part's forward runs every one of its rows to the part's longest row (at least
    one column), or with `buckets` (train.length_buckets) each of its length buckets to the bucket's
    longest (rlvr.scoring.bucket_positions); the columns past a row's own end are padding."""
    total = pad = 0
    for p in parts:
        t, d = bucket_positions(response_extent(mask[p.to(mask.device)]), buckets)
        total, pad = total + t, pad + d
    return total, pad


def minibatch_loss(learner: Learner, batch: Batch, idx: torch.Tensor, delta_rows: torch.Tensor,
                   keep: dict | None = None) -> tuple[torch.Tensor, dict]:
    """Step 6 on the rows `idx`: recompute logp (under `learner.autocast()`; the log-softmax in
    float32), ratio against logp_old, the objective with Δ, then

        loss = policy_loss(objective, dual_clip_c) + β·kl_loss   (kl_in = "loss")
                                                   - entropy_coef · entropy_bonus

    The KL is scored under the tempered distribution without the nucleus on both sides (logp_ref
    is; the policy's side comes from the same forward as logp), so it is 0 at π = π_ref whatever
    the nucleus (top_p, top_k, min_p). With kl_in = "reward" the KL is already in Δ (rlvr.rollout)
    and only logged here.
    `delta_rows` is (B,) or (B, T).

    With `batch.logp_old_pending` (the first pass, at π_old; rlvr.setup_types.logp_old_in_learn) this
    forward's own log-probs, detached, are logp_old (ratio exactly 1) and Δ is weighed per token by
    min(π_train / π_sampler, algorithm.is_cap) against the sampler's (`batch.logp_old`), as
    algorithm.logp_old = recompute weighs it in the rollout stage; `keep` {"logp_old", "delta"}, two
    (B, T) tensors, receives both at rows `idx` for the later passes."""
    ac = learner.cfg.algorithm
    sub = batch.rollout.select(idx)
    kl_on, bonus_on = batch.logp_ref is not None, ac.entropy_coef > 0
    out = training_forward(learner, sub, kl_on, bonus_on)
    logp = out if isinstance(out, torch.Tensor) else out.logp                          # (B', T)
    m = sub.mask.bool()                                                                # (B', T)
    absdiff = (logp.detach() - batch.logp_old[idx]).abs()[m].mean() if m.any() else torch.zeros(())
    logp_old, delta = batch.logp_old[idx], delta_rows[idx]
    if batch.logp_old_pending:               # π = π_old: this forward is the learner's logp_old
        logp_old = logp.detach()
        delta = learner_logp_old(learner, batch, idx, logp_old, delta_rows, keep)
    mask = batch.train_mask[idx]               # (B', T) the tokens the loss reads (algorithm.mask_truncated)
    loss, stats = losses.policy_loss(
        logp, logp_old, delta, mask, clip_eps=ac.clip_eps,
        clip_eps_high=ac.clip_eps_high or None, level=ac.ratio_level, agg=ac.agg, max_len=learner.max_len,
        objective=ac.objective, dual_clip_c=ac.dual_clip_c or None,
    )
    if kl_on:
        with contextlib.nullcontext() if ac.kl_in == "loss" else torch.no_grad():
            kl = losses.kl_loss(out.logp_full, batch.logp_ref[idx], mask, estimator=ac.kl_estimator,
                                agg=ac.agg, max_len=learner.max_len)
        if ac.kl_in == "loss":
            loss = loss + ac.kl_coef * kl
        stats["kl_ref"] = kl.item()
    if bonus_on:
        bonus = losses.entropy_bonus(out.entropy, mask, ac.agg, max_len=learner.max_len)
        loss = loss - ac.entropy_coef * bonus
        stats["policy_entropy"] = bonus.item()
    stats["logp_old_absdiff"] = float(absdiff)   # mean |logp - logp_old|; learn reports the first minibatch's
    return loss, stats


def training_forward(learner: Learner, sub: sampling.Rollout, kl_on: bool, bonus_on: bool):
    """The learn stage's forward on the rows `sub` under `learner.autocast()`: the token log-probs
    (B', T) under the sampling distribution, or TokenLogprobs with the KL's side (`kl_on`) and the
    entropies (`bonus_on`). Whatever runs it (a minibatch's loss, `prepass_logp_old`) gets the same
    numbers for the same rows and parts."""
    cfg = learner.cfg
    sc, G = cfg.sampling, cfg.train.samples_per_prompt
    with learner.autocast():
        return scoring.sequence_token_logprobs(learner.policy, sub, temperature=sc.temperature, top_p=sc.top_p,
                                                top_k=sc.top_k, min_p=sc.min_p,
                                                chunk_rows=logprobs.chunk_setting(cfg.model.logprob_chunk_rows),
                                                group_size=G if cfg.model.share_prompt_forward else None,
                                                return_full=kl_on, return_entropy=bonus_on,
                                                buckets=row_buckets(learner))


def row_buckets(learner: Learner) -> bool:
    """Whether the learner's forwards split their rows into length buckets (train.length_buckets,
    `Learner.row_buckets`)."""
    return learner.cfg.train.length_buckets and learner.row_buckets


def learner_logp_old(learner: Learner, batch: Batch, idx: torch.Tensor, logp_old: torch.Tensor,
                     delta_rows: torch.Tensor, keep: dict | None) -> torch.Tensor:
    """Rows `idx` of a batch whose logp_old is the learner's own (`batch.logp_old_pending`), given
    `logp_old` (B', T), the learner's detached log-probs at π_old: Δ per token (B', T) = Δ · w ·
    mask, with w = min(π_train / π_sampler, algorithm.is_cap) against the sampler's log-probs
    `batch.logp_old` (w's statistics: `learn`, over every row); `keep` {"logp_old", "delta"}
    receives both at `idx`."""
    sub_mask = batch.rollout.mask[idx]                                                 # (B', T)
    w, _ = losses.truncated_is_weight(logp_old, batch.logp_old[idx], sub_mask, learner.cfg.algorithm.is_cap)
    delta = delta_rows[idx]
    delta = (delta.unsqueeze(1) if delta.dim() == 1 else delta) * w * sub_mask.to(w.dtype)
    if keep is not None:
        keep["logp_old"][idx], keep["delta"][idx] = logp_old, delta
    return delta


def prepass_logp_old(learner: Learner, batch: Batch, minibatches: list[torch.Tensor], delta_rows: torch.Tensor,
                     keep: dict, shard=None) -> int:
    """logp_old (and the IS-weighted Δ, `learner_logp_old`) into `keep` for the rows of `minibatches`
    (all of epoch 0's but the first, whose own first forward gives its rows), before the first
    update: each minibatch in the `train.micro_batches` parts `accumulate` will run it in, with
    gradient enabled and the policy as the learner runs it (its graph dropped at once), so every
    minibatch's first forward in epoch 0 would compute exactly these numbers at π_old. A forward
    over other rows may not: bf16 products are not row-count invariant on every CPU, and a ratio
    off 1 by bf16 noise would be clipped as if the policy had moved (docs/guide/models.md, "Where
    logp_old comes from").

    `shard` (a rank of a learner group, rlvr.distributed.learners.Shard): the rank's own rows of each
    minibatch, in the parts `accumulate(group=True)` runs them in, and as many forwards as it runs
    (its forwards are collectives: buffer broadcasts under DDP, which runs them under `no_sync` so
    none waits for a backward; all-gathers under FSDP2), a rank short of parts repeating a group
    without keeping it. Returns the tokens of the whole minibatches (`forward_tokens`, as the
    learn stage counts its trained tokens: every rank returns the group's figure)."""
    G, n = learner.cfg.train.samples_per_prompt, learner.cfg.train.micro_batches
    shared = learner.cfg.model.share_prompt_forward and learner.policy.differentiable_cache
    kl_on, bonus_on = batch.logp_ref is not None, learner.cfg.algorithm.entropy_coef > 0
    no_sync = getattr(type(learner.policy), "no_sync", None)
    tokens = 0
    for idx in minibatches:
        mine = idx if shard is None else shard.mine(idx, G)
        parts = part_rows(learner, batch, mine) if mine.numel() else []
        counted = len(parts)
        if shard is not None:
            parts = parts + [(mine if counted else idx)[:G]] * (n - counted)
        for i, part in enumerate(parts):
            with learner.policy.no_sync() if no_sync is not None else contextlib.nullcontext():
                out = training_forward(learner, batch.rollout.select(part), kl_on, bonus_on)
            if i < counted:
                logp = out if isinstance(out, torch.Tensor) else out.logp              # (b, T)
                learner_logp_old(learner, batch, part, logp.detach(), delta_rows, keep)
                del logp
            del out                                                                    # the graph, dropped
        tokens += forward_tokens(batch.rollout, G, shared, row_buckets(learner), part_rows(learner, batch, idx))
    return tokens


def accumulate(learner: Learner, batch: Batch, rows: torch.Tensor, delta_rows: torch.Tensor,
               scale: float = 1.0, group: bool = False, keep: dict | None = None) -> dict:
    """The backward of step 6 on `rows` into the parameters' gradients, in `train.micro_batches` parts
    of whole groups: each part's forward and backward in turn, so one part's activations and logits
    are alive at a time. A part's loss is weighted by its share of the aggregation's denominator
    over `rows` (rlvr.losses.denominator: its tokens under token_mean, its rows otherwise), so the
    accumulated gradient is the whole rows' gradient (to float rounding) whatever the split; giving
    every part the same weight would not (under token_mean a part with fewer tokens would count as
    much as one with more). `scale` multiplies every backward (a learner group's share).

    `group` (a rank of a learner group): forwards and backwards are collectives there (DDP's
    all-reduce, FSDP2's gathers), so every rank runs exactly `train.micro_batches` of them, a rank
    with fewer groups than that repeating its first group at weight 0; under DDP all but the last
    run without the all-reduce (`no_sync`), which then averages the accumulated gradients once.

    Returns the statistics of the whole rows: "loss" and the others as means weighted the same way,
    *_min / *_max over the parts. `keep`: minibatch_loss's, filled by the parts that count (weight > 0)."""
    agg, mask, G = learner.cfg.algorithm.agg, batch.train_mask, learner.cfg.train.samples_per_prompt
    n = learner.cfg.train.micro_batches
    parts = part_rows(learner, batch, rows)
    total = losses.denominator(mask[rows], agg).clamp(min=1)
    weights = [1.0] if len(parts) == 1 else [float(losses.denominator(mask[p], agg) / total) for p in parts]
    if group and len(parts) < n:
        parts, weights = parts + [parts[0][:G]] * (n - len(parts)), weights + [0.0] * (n - len(parts))
    no_sync = getattr(type(learner.policy), "no_sync", None)
    out: dict[str, float] = {}
    for i, (part, w) in enumerate(zip(parts, weights)):
        local = no_sync is not None and i < len(parts) - 1
        with learner.policy.no_sync() if local else contextlib.nullcontext():
            loss, stats = minibatch_loss(learner, batch, part, delta_rows, keep if w > 0 else None)
            (loss * (w * scale) if w * scale != 1.0 else loss).backward()
        stats["loss"] = loss.item()
        for key, v in stats.items():
            if key.endswith("_min") or key.endswith("_max"):
                out[key] = v if i == 0 else (min if key.endswith("_min") else max)(out[key], v)
            else:
                out[key] = out.get(key, 0.0) + w * v
    return out


def own_rows(batch: Batch, split: list[torch.Tensor], shard, G: int) -> torch.Tensor:
    """(B,) bool: the rows this rank of a learner group computes over the minibatches `split`."""
    own = torch.zeros(batch.logp_old.shape[0], dtype=torch.bool, device=batch.logp_old.device)
    for idx in split:
        own[shard.mine(idx, G)] = True
    return own


def step_if_finite(learner: Learner, loss: float, gnorm: torch.Tensor) -> bool:
    """One optimizer and schedule step, unless the loss or the gradient norm is not finite (then no
    update). Returns whether the step was taken."""
    if math.isfinite(loss) and math.isfinite(float(gnorm)):
        learner.opt.step()
        learner.sched.step()
        return True
    return False


def adopt_first_pass(batch: Batch, keep: dict, own: torch.Tensor | None, shard,
                     is_cap: float) -> tuple[Batch, dict]:
    """`batch` with the logp_old and Δ·w its first pass computed (`keep`), for the passes after it, and
    the IS weight's figures (sampler_*) over every row (against `batch.logp_old`, the sampler's), not
    one minibatch's. `own` (a learner group's rank): its rows, gathered with every other rank's on
    every rank, since a later pass draws them elsewhere."""
    if own is not None:
        keep = shard.gather_rows(keep, own)
    _, w_stats = losses.truncated_is_weight(keep["logp_old"], batch.logp_old, batch.rollout.mask, is_cap)
    first_sampler = {f"sampler_{k}": v for k, v in w_stats.items()}
    return dataclasses.replace(batch, logp_old=keep["logp_old"], delta_tokens=keep["delta"],
                               logp_old_pending=False, logp_old_version=batch.version), first_sampler


def learn(learner: Learner, batch: Batch, *, delta_rows: torch.Tensor | None = None, shard=None) -> dict:
    """μ passes over the batch, each split into minibatches of whole groups; one clipped AdamW step
    per minibatch. Returns the mean of each statistic over the minibatches, the first minibatch's
    ratio (π = π_old there: 1 up to rounding), the last learning rate and the tokens and FLOPs computed,
    and learn_padding_frac: the share of the response positions the training forwards computed that
    lay past their row's end (`padding_positions`; lower with train.length_buckets).
    When logp_old is the sampler's own (`batch.logp_old_version` None), also sampler_logp_absdiff:
    the first minibatch's mean |logp_sampler - logp_train| over generated tokens, the two passes'
    disagreement at equal weights (with logp_old recomputed, the rollout stage reports it). With
    `batch.logp_old_pending` (rlvr.setup_types.logp_old_in_learn) the first minibatch's forwards give its
    rows' logp_old and the IS-weighted Δ (`minibatch_loss`), and with more minibatches the others'
    come from forwards over their own parts before the first update (`prepass_logp_old`; their
    tokens returned as logp_old_forward_tokens and counted in the FLOPs); the later minibatches and
    passes (train.epochs_per_batch > 1) reuse them; the weight's figures (over every row) are
    reported as sampler_is_weight_mean and the rest, as the rollout stage would. In a learner group
    each rank computes its own rows so (the parts and forwards it will run), and after the first
    minibatch the ranks exchange them (`Shard.gather_rows`): the later passes draw other minibatches.

    `delta_rows`: (B,) or (B, T) Δ to use instead of `batch.delta_rows` (rlvr.distributed.staleness
    passes Δ times a truncated importance weight). `shard`: this process's rank of a learner group
    (rlvr.distributed.learners.Shard): it takes the rank's whole groups of each minibatch, the loss
    scale that makes the group's summed gradient the one-process gradient, and the statistics
    reduced over the ranks. None: one process, the whole minibatch."""
    cfg, policy = learner.cfg, learner.policy
    tc, G = cfg.train, cfg.train.samples_per_prompt
    shared = cfg.model.share_prompt_forward and policy.differentiable_cache
    if delta_rows is None:
        delta_rows = batch.delta_rows
    delta_rows = delta_rows.to(batch.rollout.mask.device)                               # (B,) or (B, T)
    view = learner if shard is None else dataclasses.replace(learner, policy=shard.model, row_buckets=False)
    fwd_flops, train_flops = learner.flops
    params = policy.trainable_params()
    policy.train()
    acc: dict[str, float] = {}
    first_ratio, first_absdiff, lr_used, n_mb, trained, skipped = 1.0, 0.0, 0.0, 0, 0, 0
    sampler_logp_old, first_sampler = batch.logp_old_version is None, {}
    keep, own, prepass_tokens = None, None, 0
    positions, padding = 0, 0            # response positions the training forwards computed, and their padding
    if batch.logp_old_pending:   # the first pass fills these; later passes read them
        keep = {"logp_old": batch.logp_old.clone(), "delta": torch.zeros_like(batch.logp_old)}
    for _epoch in range(tc.epochs_per_batch):
        split = minibatch_rows(learner, len(batch.groups.examples), G)
        if keep is not None and shard is not None:   # the rows this rank's first pass computes
            own = own_rows(batch, split, shard, G)
        if keep is not None and len(split) > 1:
            prepass_tokens = prepass_logp_old(view, batch, split[1:], delta_rows, keep, shard)
        for idx in split:
            mine, scale = (idx, None) if shard is None else shard.rows(idx, G, batch.train_mask, cfg.algorithm.agg)
            learner.opt.zero_grad(set_to_none=True)
            computed, pad = padding_positions(batch.rollout.mask, part_rows(view, batch, mine), row_buckets(view))
            positions, padding = positions + computed, padding + pad
            stats = accumulate(view, batch, mine, delta_rows, 1.0 if scale is None else scale, group=shard is not None,
                               keep=keep)
            gnorm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip if tc.grad_clip > 0 else float("inf"))
            if shard is not None:  # the whole minibatch's figures, the same on every rank
                stats = shard.reduce(stats)
            lr_used = learner.sched.get_last_lr()[0]
            if not step_if_finite(learner, stats["loss"], gnorm):  # no update (train/skipped_updates)
                skipped += 1
            trained += forward_tokens(batch.rollout, G, shared, row_buckets(view), part_rows(view, batch, idx))
            stats["grad_norm"] = float(gnorm)
            absdiff = stats.pop("logp_old_absdiff")
            if keep is not None:  # logp_old and Δ·w of the first pass, for the passes after it
                batch, first_sampler = adopt_first_pass(batch, keep, own, shard, cfg.algorithm.is_cap)
                delta_rows, keep = batch.delta_rows, None
            for k, v in stats.items():
                acc[k] = acc.get(k, 0.0) + v
            if n_mb == 0:  # the first optimizer step of a batch sees π = π_old: ratio 1
                first_ratio, first_absdiff = stats["ratio_mean"], absdiff
            n_mb += 1
    sampler = {"sampler_logp_absdiff": first_absdiff, **first_sampler} if sampler_logp_old else {}
    return {**{k: v / n_mb for k, v in acc.items()}, "first_step_ratio_mean": first_ratio, "lr": lr_used,
            "optimizer_steps": n_mb, "skipped_updates": skipped, "trained_tokens": trained,
            "logp_old_forward_tokens": prepass_tokens, "learn_padding_frac": padding / max(1, positions),
            "flops": trained * train_flops + prepass_tokens * fwd_flops, **sampler}


LEARN_PROBE_RETRIES = 2
"""Timed pairs `learn_part_seconds` adds while the larger part measured no longer than the smaller."""
OPTIMIZER_PROBE_ELEMENTS = 1 << 22
"""The most elements of the scratch parameter `learn_part_seconds` times an optimizer step on (the
step's time then scales with the trainable parameter count: it is bound by memory bandwidth)."""


def learn_part_seconds(setup: Setup) -> tuple[float, float, float, int]:
    """(seconds of one `train.micro_batches` part's training forward and backward, seconds of one
    optimizer step, seconds of that part at the expected response lengths, this process's peak
    resident bytes while a whole part ran), measured on this run's policy before it trains, to
    price the learn stage's time and memory.

    The part: ceil(groups per minibatch / parts) groups of G rows at the longest prompt's length
    and the full response bound T (every token in the loss, as the price counts them), through the
    learn stage's own `rlvr.learn.accumulate` (its forward under the run's numerics, the loss with
    the run's terms, the backward), on synthetic rows with Δ = ±1. A part of one or two groups is
    timed as it is (a warm-up call, then the best of two); a larger one from the times of one and of
    two groups (each the best of two calls, timed in turn; the pair again, each call's best kept,
    while two groups measured no longer than one: LEARN_PROBE_RETRIES), extrapolated linearly in
    the groups: on SmolLM2 (8 groups a part) 6 group-sized calls instead of two whole parts. The
    probe's rows run to T, so the price stays an upper estimate where responses end early. Where
    the price is at an expected length (below), the part at T no longer sets the expected time (the
    part at the expected lengths does; the part at T is only the line's cap-based figure and the
    memory peak), so it is timed once: its first call, without the warm-up and the best of two (an
    upper estimate of it, and two of the probe's longest calls fewer). The gradients are dropped
    after (set to None), the parameters and every generator of the run untouched (torch's global
    RNG forked).
    The optimizer step: the run's optimizer (rlvr.learn.make_optimizer) over a scratch parameter of
    min(trainable parameters, OPTIMIZER_PROBE_ELEMENTS) elements, its state allocated by a first
    step, the best of three steps, scaled to the trainable parameter count.
    The part at the expected lengths (sampling.expected_response_tokens below T; else 0): the same
    groups with their rows at the length model's quantiles (rlvr.lengths.part_lengths), through the
    same `accumulate`, its length buckets cut as the learn stage cuts them (train.length_buckets),
    the best of two calls (no warm-up: the calls at T just ran; a first call's costs at the new
    widths stay in the first of the two). The price takes it as its learn part there: a part's time
    is not proportional to its positions (each bucket's forward and backward costs something
    whatever its width, and narrow products run below the matmul rate).
    With a learner group (distributed.learners > 1) on this machine: one rank's share of a
    minibatch at a learner actor's threads (rlvr.probes.learn_probe_share; this process's threads
    restored after); the ranks' gradient all-reduce is not timed.
    The peak (rlvr.procmem.ResidentPeak over the part's calls): where the probe runs a whole part
    (one or two groups) on the CPU in this process (no learner group), the resident set at the part's
    peak: everything the process holds then, the allocator's free-but-kept memory included, which
    the price's count of tensors does not see; 0 where not measured.
    (0.0, 0.0, 0.0, 0) where the learners cannot be timed here (a cluster, another kind of device)
    or there is nothing to train."""
    cfg, model, device = setup.cfg, setup.model, setup.device
    tc = cfg.train
    params = model.trainable_params()
    share = learn_probe_share(setup)
    if share is None or not params:
        return 0.0, 0.0, 0.0, 0
    per_mb, threads = share                                            # groups in a (rank's) minibatch
    per_part = -(-per_mb // min(tc.micro_batches, per_mb))             # groups in one of its parts
    timed = _part_timer(setup, params)
    was, was_threads = model.training, torch.get_num_threads()
    model.train()
    torch.set_num_threads(threads)
    peak, T = 0, setup.limits.max_new_tokens
    at_expected = 0 < cfg.sampling.expected_response_tokens < T     # the part at T then timed once
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if per_part <= 2:
                resident = ResidentPeak() if device.type == "cpu" and cfg.distributed.learners <= 1 else None
                with resident or contextlib.nullcontext():
                    part = timed(per_part)                 # at an expected length the one call; else a warm-up
                    if not at_expected:
                        part = min(timed(per_part), timed(per_part))
                peak = resident.peak if resident else 0
            else:   # each size's best of two (the first call of each is its warm-up; one call each at an
                # expected length); a busy core can make the larger part the shorter: the pair again
                one, two = ordered_pair(lambda: timed(1), lambda: timed(2), LEARN_PROBE_RETRIES,
                                        rounds=1 if at_expected else 2)
                part = one + max(two - one, 0.0) * (per_part - 1)
            expected = 0.0
            if at_expected:                                          # the part at the expected lengths
                G = cfg.train.samples_per_prompt
                at = _part_timer(setup, params, T, part_lengths(
                    length_survival(cfg.sampling.expected_response_tokens, T), per_part, G))
                expected = min(at(per_part), at(per_part))             # warmed by the calls at T
        step = _optimizer_step_seconds(params, tc, device)
    finally:
        model.train(was)
        torch.set_num_threads(was_threads)
    return part, step, expected, peak


def _probe_batch(setup: Setup, groups: int, T: int, lengths: list[int] | None = None) -> Batch:
    """`groups` groups of G synthetic rows for `learn_part_seconds`: pad prompts of the longest
    prompt's length, every one of the T response tokens in the loss, Δ = ±1; with `lengths` (a
    length a row) row i's first lengths[i] tokens, the rest padding (attention mask 0, out of the loss)."""
    cfg, device = setup.cfg, setup.device
    G = cfg.train.samples_per_prompt
    Lp, pad = max(1, setup.limits.prompt_tokens), setup.tokenizer.pad_id
    B = groups * G
    mask = torch.ones((B, T), device=device)
    if lengths is not None:
        mask = (torch.arange(T, device=device)[None] < torch.tensor(lengths, device=device)[:, None]).float()
    ro = sampling.Rollout(
        ids=torch.full((B, Lp + T), pad, dtype=torch.long, device=device),
        attention_mask=torch.cat([torch.ones((B, Lp), dtype=torch.long, device=device), mask.long()], dim=1),
        prompt_len=Lp, mask=mask, logp=torch.zeros((B, T), device=device),
        truncated=torch.zeros(B, dtype=torch.bool, device=device), temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k, min_p=cfg.sampling.min_p)
    delta = (torch.arange(B, device=device) % 2 * 2 - 1).float().view(groups, G)  # Δ = ±1
    return Batch(groups=types.SimpleNamespace(rollout=ro), parts=[], delta=delta, logp_old=ro.logp.clone(),
                 logp_ref=ro.logp.clone() if cfg.algorithm.kl_coef > 0 else None, version=0)


def _part_timer(setup: Setup, params: list, T: int | None = None,
                lengths: list[int] | None = None) -> Callable[[int], float]:
    """groups -> seconds of one `accumulate` (forward, loss, backward) over a synthetic batch of that
    many groups of T response columns (None: the run's bound), its rows of `lengths` where given
    (`_probe_batch`), the gradients dropped after."""
    cfg, device = setup.cfg, setup.device
    G, T = cfg.train.samples_per_prompt, T or setup.limits.max_new_tokens
    one_part = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batches=1))
    learner = Learner(setup.model, None, None, one_part, torch.Generator(device=device), T, (0, 0),
                      autocast=setup.numerics.context)
    made = {}

    def timed(groups: int) -> float:
        if groups not in made:
            made[groups] = _probe_batch(setup, groups, T, lengths)
        b = made[groups]
        dt = time_calls(lambda: accumulate(learner, b, torch.arange(groups * G, device=device), b.delta_rows),
                        device)
        for p in params:
            p.grad = None
        return dt
    return timed


def _optimizer_step_seconds(params: list, tc: config_mod.TrainConfig, device: torch.device) -> float:
    """Seconds of one step of the run's optimizer over `params`: the best of three steps over a
    scratch parameter of min(their elements, OPTIMIZER_PROBE_ELEMENTS), its state allocated by a
    first step, scaled to their element count (the step is bound by memory bandwidth)."""
    n = sum(p.numel() for p in params)
    scratch = torch.zeros(min(n, OPTIMIZER_PROBE_ELEMENTS), dtype=params[0].dtype, device=device,
                          requires_grad=True)
    scratch.grad = torch.zeros_like(scratch)
    opt = make_optimizer([scratch], tc)
    opt.step()                                                      # its state, allocated once
    best = min(time_calls(opt.step, device) for _ in range(3))
    return best * n / scratch.numel()
