"""Scaling a run out: rollout workers on Ray, a torch.distributed learner group, bounded staleness.

The loop keeps its two stages; `open_distributed` returns an object with the same two calls::

    with open_distributed(cfg, setup, learner, version, log=log, builder=build) as dist:   # None: not distributed
        batch = (dist.rollout if dist else rollout)(setup, policy, reference, draw, version=v, generator=g, pool=p)
        stats = (dist.learn if dist else learn)(learner, batch)

- `distributed.rollout_workers = N` (rlvr.distributed.rollout_workers): the step's prompts are
  sampled and scored by N Ray actors; the merged rows are the rows one process would draw (sampling
  is seeded per prompt). Δ, logp_ref and the record stay in the trainer.
- `distributed.learners = N` (rlvr.distributed.learners): the update runs on N ranks with DDP (or
  FSDP2, `distributed.sharding = "fsdp2"`: rlvr.distributed.fsdp) and the global token count; the
  weights equal the one-process update's.
- After each update the trainable weights go to the workers as the next policy version
  (rlvr.distributed.sync), timed as `train/sync_s`.
- `distributed.max_staleness > 0` (rlvr.distributed.staleness): the workers sample step t+1 while
  the learners learn step t (up to k batches in flight), and the update uses the truncated
  importance-sampling correction.

An engine seam: a worker talks to its policy only through rlvr.policy.Policy (generate, logp) and
`sync.load_weights`; a vLLM or SGLang worker is one more actor class with `sample` and
`set_weights` (see README, "Running on a Ray cluster").
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Callable, Iterator

from rlvr.learn import Learner, learn
from rlvr.rollout import Batch, rollout


class Distributed:
    """The distributed versions of the rollout and learn stages, with the state they share.
    `builder(cfg, log=...) -> Setup`: how each actor builds its copy of the run (the trainer passes
    rlvr.build.build; this package never imports the builder)."""

    def __init__(self, cfg, setup, learner: Learner, version: int, first_step: int, log=print, *,
                 builder: Callable):
        from rlvr.distributed import sync

        d = cfg.distributed
        self.cfg, self.log, self.version = cfg, log, version
        actors_cfg = resolved_numerics(cfg, setup)
        self.steps_left = cfg.train.steps - first_step
        cpus = d.cpus_per_worker * (d.rollout_workers + d.learners - 1)
        self._own_ray = sync.start_ray(d.address, cpus)
        self.workers = self.group = None
        self._pending: collections.deque = collections.deque()  # Jobs sampled ahead (max_staleness > 0), oldest first
        self._draw = self._generator = None
        try:
            if d.rollout_workers:
                from rlvr.distributed.rollout_workers import RolloutWorkers

                self.workers = RolloutWorkers(actors_cfg, learner.policy, version, setup.tokenizer.pad_id, log,
                                              builder=builder)
                log(f"distributed: {d.rollout_workers} rollout workers ({d.cpus_per_worker:g} CPU, "
                    f"{d.gpus_per_worker:g} GPU each); {self.workers.sync_bytes / 1e6:.2f} MB per weight sync")
            if d.learners > 1:
                from rlvr.distributed.learners import LearnerGroup

                self.group = LearnerGroup(actors_cfg, learner, builder)
                log(f"distributed: {d.learners} learners (torch.distributed, {d.sharding.upper()})")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ rollout stage
    def rollout(self, setup, policy, reference, examples_fn, *, version: int, generator, pool=None,
                value=None) -> Batch:
        """rlvr.rollout.rollout with the sampling on the workers (or in this process without workers).
        With a batch sampled ahead, its prompts and version are used (no new draw)."""
        if self.workers is None:
            return rollout(setup, policy, reference, examples_fn, version=version, generator=generator, pool=pool,
                           value=value)
        self._draw, self._generator = examples_fn, generator
        now = version  # the trainer's weights: algorithm.logp_old = recompute scores the rows with them
        job = self._pending.popleft() if self._pending else None
        if job is not None:
            examples_fn, version = (lambda: job.examples), job.version

        def sample(examples: list):
            nonlocal job
            if job is None or job.examples is not examples:
                job = self.workers.submit(examples, generator)
            return self.workers.collect(job)

        return rollout(setup, policy, reference, examples_fn, version=version, generator=generator, pool=pool,
                       value=value, sampler=sample, policy_version=now)

    # ------------------------------------------------------------------ learn stage
    def learn(self, learner: Learner, batch: Batch) -> dict:
        """One update (on the learner group when there is one), then the weight sync to the workers.
        With max_staleness > 0 the next step's sampling is started first, on the current weights,
        and the batch is corrected for its staleness (rlvr.distributed.staleness)."""
        from rlvr.distributed import staleness

        self.steps_left -= 1
        k = self.cfg.distributed.max_staleness
        while self.workers is not None and len(self._pending) < min(k, self.steps_left):
            self._pending.append(self.workers.submit(self._draw(), self._generator))
        batch, delta_rows, extra = staleness.correct(learner.policy, batch, self.cfg, self.version, learner.autocast)
        if self.group is not None:
            stats = self.group.learn(batch, delta_rows)
        else:
            stats = learn(learner, batch, delta_rows=delta_rows)
        self.version += 1
        sync_s = (self.workers.sync(learner.policy, self.version, wait=not self._pending)
                  if self.workers is not None else 0.0)
        return {**stats, **extra, "sync_s": sync_s,
                "worker_restarts": float(self.workers.restarts if self.workers is not None else 0)}

    def close(self) -> None:
        import ray

        if self.workers is not None:
            self.workers.close()
        if self.group is not None:
            self.group.close()
        if self._own_ray:
            ray.shutdown()


def resolved_numerics(cfg, setup):
    """`cfg` with model.autocast set to what this process chose (bf16 or off), for the actors: each
    builds its own copy of the run, and `auto` must not measure again and perhaps choose otherwise
    (a sampler and a learner in different numerics)."""
    mode = "bf16" if setup.numerics.bf16 else "off"
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, autocast=mode))


def is_distributed(cfg) -> bool:
    d = cfg.distributed
    return bool(d.rollout_workers or d.learners > 1)


@contextlib.contextmanager
def open_distributed(cfg, setup, learner: Learner, version: int, first_step: int = 0, log=print, *,
                     builder: Callable) -> Iterator[Distributed | None]:
    """The run's Distributed (Ray started or joined, actors built by `builder`), closed at the end;
    None when `[distributed]` asks for nothing (rollout_workers = 0, learners = 1)."""
    if not is_distributed(cfg):
        yield None
        return
    t0 = time.perf_counter()
    d = Distributed(cfg, setup, learner, version, first_step, log, builder=builder)
    log(f"distributed: ready in {time.perf_counter() - t0:.1f}s")
    try:
        yield d
    finally:
        d.close()
