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

    π_old        = the learner's weights when the update starts (one no-grad forward, "proximal")
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
"""

from __future__ import annotations

import dataclasses

import torch

from rlvr import sampling
from rlvr.rollout import Batch


def truncated_is_weight(logp_old: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor, cap: float
                        ) -> tuple[torch.Tensor, dict]:
    """(B, T) w = min(exp(logp_old - logp_behav), cap) on generated tokens (1 elsewhere), and its statistics."""
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


@torch.no_grad()
def correct(policy, batch: Batch, cfg, learner_version: int) -> tuple[Batch, torch.Tensor | None, dict]:
    """(batch with logp_old = π_old's log-probs, per-token Δ·w or None, stats) for a batch sampled at
    `batch.version` and learned at `learner_version`. A fresh batch is returned as it is."""
    staleness = learner_version - batch.version
    if staleness == 0:
        return batch, None, {"staleness": 0.0, "is_weight_mean": 1.0, "is_weight_max": 1.0, "is_truncated_frac": 0.0}
    sc, G = cfg.sampling, cfg.train.samples_per_prompt
    policy.eval()
    logp_old = sampling.sequence_token_logprobs(policy, batch.rollout, temperature=sc.temperature, top_p=sc.top_p,
                                                chunk_rows=cfg.model.logprob_chunk_rows or None,
                                                group_size=G if cfg.model.share_prompt_forward else None)  # (B, T)
    w, stats = truncated_is_weight(logp_old, batch.logp_old, batch.rollout.mask, cfg.distributed.is_cap)
    d = batch.delta_rows.to(w.device)                                         # (B,) or (B, T) (per-token Δ)
    delta_rows = (d.unsqueeze(1) if d.dim() == 1 else d) * w                  # (B, T)
    return dataclasses.replace(batch, logp_old=logp_old.detach()), delta_rows, {"staleness": float(staleness), **stats}
