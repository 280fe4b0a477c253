"""Bounded staleness: learning from rows sampled by an older policy, and the correction it needs.

With `distributed.max_staleness = k > 0` the rollout workers sample step t+1 while the learners
learn step t, so the rows of a batch come from the behaviour policy π_behav (version v_b) while
the learner is at version v_l ≥ v_b; the measured staleness is v_l − v_b (logged each step as
`train/staleness`; k batches are kept in flight, so it is at most k).

Reusing old samples needs explicit treatment: the PPO ratio π_θ / π_behav would measure the
trust region from a policy the learner has already left, and the plain surrogate is the
gradient at π_behav, not at the current weights. The choice here is named
**decoupled PPO with truncated importance sampling** (Hilton et al. 2021's decoupled objective,
with the importance weight truncated as in Yao et al. 2025's TIS and IMPALA's V-trace):

    π_old        = the learner's weights when the update starts (one forward without a backward, "proximal")
    ratio_t      = π_θ(y_t) / π_old(y_t)                       clipped as usual (trust region)
    w_t          = min(π_old(y_t) / π_behav(y_t), C)           stop-gradient, C = distributed.is_cap
    loss_t       = w_t · ppo_clip(ratio_t, Δ)                  = ppo_clip(ratio_t, w_t · Δ), w_t ≥ 0

π_behav(y_t) is the sampler's stored log-prob (Batch.logp_old as sampled). Since w_t > 0 scales
every objective linearly (ppo_clip, its dual clip, cispo), the weight is folded into a per-token
Δ. The truncation at C bounds the variance a token whose probability rose a lot can add, at the
price of a bias toward π_behav on those tokens (`is_truncated_frac` says how many). On a fresh
batch (staleness 0) π_old = π_behav, w = 1 and nothing changes: the synchronous update.
Logged: staleness, the mean and max of w, the truncated fraction and the spread of
π_old / π_behav; the clip fractions and ratio spread come from the loss as always.

The same correction (rlvr.rollout.off_policy_correction) serves `algorithm.logp_old = "recompute"`,
where π_behav is the sampler's numerics (bf16 autocast, incremental decoding) rather than older
weights. With both on, the rollout stage already scores each batch with the learner's current
weights (the workers sampled ahead with older ones), so its one weight min(π_old / π_sampler,
algorithm.is_cap) covers staleness and numerics together, and `correct` adds no second forward.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from rlvr.losses import truncated_is_weight  # noqa: F401  (the weight; defined beside the other loss terms)
from rlvr.rollout import Batch, off_policy_correction


def correct(policy, batch: Batch, cfg, learner_version: int, autocast=contextlib.nullcontext
            ) -> tuple[Batch, torch.Tensor | None, dict]:
    """(batch with logp_old = π_old's log-probs, per-token Δ·w or None, stats) for a batch sampled at
    `batch.version` and learned at `learner_version` (rlvr.rollout.off_policy_correction, π_old's
    forward under the training numerics `autocast()`, C = distributed.is_cap). A fresh batch is
    returned as it is; so is one whose logp_old a forward of the learner's weights already gave
    (algorithm.logp_old = recompute: its Δ already carries the one weight min(π_old / π_sampler,
    algorithm.is_cap), which covers the staleness as well)."""
    staleness = learner_version - batch.version
    if staleness == 0:
        return batch, None, {"staleness": 0.0, "is_weight_mean": 1.0, "is_weight_max": 1.0, "is_truncated_frac": 0.0}
    if batch.logp_old_version == learner_version:
        return batch, None, {"staleness": float(staleness)}
    logp_old, delta_rows, stats = off_policy_correction(policy, batch, cfg, cfg.distributed.is_cap, autocast)
    batch = dataclasses.replace(batch, logp_old=logp_old, logp_old_version=learner_version)
    return batch, delta_rows, {"staleness": float(staleness), **stats}
