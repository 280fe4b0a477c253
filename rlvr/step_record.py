"""A step's record: its metrics.jsonl row (what the batch held, what the update did, what it cost),
its warnings and a few of its groups in the run directory (rlvr.rundir). The trainer calls both
once a step, after the learn stage."""

from __future__ import annotations

import time

from rlvr import advantages
from rlvr.diagnostics import (Watch, agreement_breakdown, length_by_outcome, missing_symbols, pass_rate_histogram,
                              response_concentration)
from rlvr.rollout import Batch
from rlvr.rundir import RunDir


def step_row(step: int, batch: Batch, stats: dict, sampled_tokens: int, t0: float) -> dict:
    """The metrics.jsonl row of one step: what the batch held, what the update did, what it cost
    (`sampled_tokens`: the run's count so far; `t0`: when the step began, perf_counter)."""
    groups, mask, logp_old = batch.groups, batch.rollout.mask, batch.logp_old
    lengths = batch.rollout.response_lengths.cpu()
    row = {
        "step": step,
        "train/reward": float(groups.rewards.mean()),
        "train/goal": float(groups.hits.float().mean()),
        "train/nonzero_delta_frac": advantages.nonzero_fraction(batch.delta),
        # of the groups first sampled this step (before dynamic sampling dropped any)
        "train/agreeing_groups_frac": float(advantages.agreeing_groups(batch.parts[0].rewards).float().mean()),
        "train/groups": len(groups.examples),
        "train/sampling_rounds": len(batch.parts),
        "train/pass_rate_hist": pass_rate_histogram(groups.hits),
        **agreement_breakdown(batch.parts[0].rewards, batch.parts[0].hits),
        **response_concentration(groups.responses),
        **missing_symbols([e.answer for e in groups.examples], groups.responses, groups.rewards.shape[1]),
        "train/response_len": float(lengths.float().mean()),
        **{f"train/response_len_{k}": v for k, v in
           length_by_outcome(lengths, groups.hits.view(-1), batch.rollout.truncated.cpu()).items()},
        # -logp of the sampled tokens is an unbiased estimate of the per-token sampling entropy
        "train/entropy": float(-(logp_old * mask).sum() / mask.sum().clamp(min=1)),
        "train/truncated_frac": float(batch.rollout.truncated.float().mean()),
        "train/reward_failures": sum(p.failures for p in batch.parts),
        # each failure status (timeout, crashed, exit, error, ...) counted over the step's rollouts
        **{f"train/reward_status_{k}": sum(p.status_counts.get(k, 0) for p in batch.parts)
           for k in batch.parts[0].status_counts if k != "ok"},
        "train/lr": stats["lr"],
        "train/sampled_tokens": sampled_tokens,
        "train/policy_version": batch.version,
        "time/sample_s": batch.sample_s,
        "time/score_s": batch.score_s,
        "time/step_s": time.perf_counter() - t0,
        "train/first_step_ratio_mean": stats["first_step_ratio_mean"],
        **{f"train/{k}": v for k, v in stats.items()
           if k not in ("lr", "first_step_ratio_mean", "optimizer_steps", "trained_tokens", "flops",
                        "logp_old_forward_tokens")},
        **{f"train/{k}": v for k, v in batch.stats.items()},   # rollout-stage figures (rlvr.rollout.Batch.stats)
    }
    for name, vals in groups.per_reward.items():
        row[f"train/reward_{name}"] = sum(vals) / len(vals)
    used = [p.tools for p in batch.parts if p.tools is not None]
    if used:  # the tool loop (rlvr.tools), over every sampling round of the step
        responses = sum(len(p.responses) for p in batch.parts)
        row["train/tool_calls_per_response"] = sum(t.calls for t in used) / responses
        row["train/tool_errors"] = sum(t.errors for t in used)
        row["train/tool_malformed"] = sum(t.malformed for t in used)
        row["train/tool_inserted_tokens"] = sum(t.inserted_tokens for t in used)
        rounds = sum(t.rounds for t in used)   # continuation rounds, and how many went on from the KV cache
        row["train/tool_rounds_on_cache_frac"] = sum(t.rounds_on_cache for t in used) / rounds if rounds else 0.0
    return row


def record(run_dir: RunDir, watch: Watch, step: int, batch: Batch, row: dict, rollouts_per_step: int) -> None:
    """Write the step's row, its warnings (the reward pool's and the tool loop's failures, `watch`'s
    findings) and `rollouts_per_step` of its groups (log.rollouts_per_step)."""
    run_dir.metrics(row)
    if row["train/reward_failures"]:
        errors = [e for p in batch.parts for e in p.errors]
        statuses = {k: sum(p.status_counts.get(k, 0) for p in batch.parts) for k in batch.parts[0].status_counts}
        what = "reward or goal" if statuses.get("goal_error") else "reward"
        run_dir.warn(step, f"{row['train/reward_failures']} {what} calls failed (scored 0, see train/reward_failures): "
                     f"{ {k: v for k, v in statuses.items() if v} }" + (f"; first error: {errors[0]}" if errors else ""))
    if row.get("train/tool_errors"):
        first = next(t.first_error for p in batch.parts if p.tools is not None for t in [p.tools] if t.first_error)
        run_dir.warn(step, f"{row['train/tool_errors']} tool calls failed (their responses ended there, see "
                     f"train/tool_errors); first error: {first}")
    for msg in watch.after_step(step, row):
        run_dir.warn(step, msg)
    run_dir.rollouts(step, batch.groups, batch.delta, rollouts_per_step)
