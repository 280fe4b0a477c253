"""Rollout workers: Ray actors that sample and score whole groups with their own copy of the policy.

The trainer splits a step's P prompts into contiguous shards of whole prompts (one per worker),
draws ONE base seed for the sampling call from its generator (as the in-process path does) and
sends each worker its shard with the index of its first prompt. Sampling is seeded per prompt
(rlvr.sampling.prompt_generators), so the merged rows are the rows one process would have drawn,
whatever the number of workers. Rewards and goal checks run in the worker, through its own reward
pool (task.reward_workers, same statuses and timeouts as in the trainer).

Each worker records the policy version of its weights; every shard comes back tagged with it and
the trainer checks it is the version it asked for.

Faults: a shard whose worker died (``ray.kill``, a crash, a lost node) or did not answer within
``distributed.timeout_s`` is sampled again by a fresh worker built from the initial weights plus
the latest sync: same seed, same rows. The trainer is told what happened (``log`` and the
``worker_restarts`` counter); after ``MAX_RETRIES`` failures of one shard the run stops with a
RunError instead of hanging.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch

from rlvr import sampling
from rlvr.distributed.sync import full_state, load_weights, state_bytes, trainable_state
from rlvr.groups import Groups, merge, sample_and_score
from rlvr.machine import actor_threads
from rlvr.setup_types import RunError

MAX_RETRIES = 2
"""Fresh workers tried for one shard before the run stops."""


class RolloutWorker:
    """The actor body (wrapped with ``ray.remote`` by ``RolloutWorkers``): one policy copy, one reward pool.
    `builder(cfg, log=...) -> Setup` builds the copy (the trainer passes rlvr.build.build)."""

    def __init__(self, cfg, weights: dict, version: int, threads: int, builder: Callable):
        torch.set_num_threads(threads)
        from rlvr.hostmem import set_host_memory
        from rlvr.reward_pool import open_pool

        # as the trainer's process does (rlvr.hostmem)
        set_host_memory(cfg.train.host_memory, cfg.model.gradient_checkpointing)

        self.setup = builder(cfg, log=lambda *_: None)
        load_weights(self.setup.model, weights)
        self.version = version
        self._stack = contextlib.ExitStack()
        self.pool = self._stack.enter_context(open_pool(cfg.task, self.setup.task))

    def set_weights(self, version: int, weights: dict) -> int:
        """Load a sync (trainable parameters) and take its version."""
        load_weights(self.setup.model, weights)
        self.version = version
        return version

    def sample(self, examples: list, base_seed: int, first_prompt: int) -> tuple[int, Groups]:
        """(version, scored groups) of `examples`, prompt i seeded by (base_seed, first_prompt + i)."""
        s = self.setup
        cfg = s.cfg
        s.model.eval()
        groups = sample_and_score(s.model, s.tokenizer, s.task, examples, G=cfg.train.samples_per_prompt,
                                  limits=s.limits, weights=s.reward_weights, temperature=cfg.sampling.temperature,
                                  top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k, min_p=cfg.sampling.min_p,
                                  generator=None, pool=self.pool, base_seed=base_seed,
                                  first_prompt=first_prompt, autocast=s.numerics.context)
        return self.version, groups

    def close(self) -> None:
        self._stack.close()


def shards(n: int, workers: int) -> list[tuple[int, int]]:
    """(first, count) of each worker's contiguous share of n prompts, as even as possible; empty shares dropped."""
    base, extra = divmod(n, workers)
    out, first = [], 0
    for w in range(workers):
        count = base + (1 if w < extra else 0)
        if count:
            out.append((first, count))
        first += count
    return out


@dataclass
class Job:
    """One sampling call in flight: its prompts, seed, expected version and one Ray reference per shard."""

    examples: list
    base_seed: int
    version: int
    parts: list  # [(worker index, first, count, ObjectRef)]
    submitted: float
    weights: object = None
    """Ray reference of the weights the job was sampled with (None = the initial weights)."""


class RolloutWorkers:
    """N rollout worker actors, their weights and versions; `submit` / `collect` one sampling call.
    `builder(cfg, log=...) -> Setup`: how each actor builds its run (the trainer passes rlvr.build.build;
    a function reference, pickled by name)."""

    def __init__(self, cfg, policy, version: int, pad_id: int, log=print, *, builder: Callable):
        import ray

        d = cfg.distributed
        self.cfg, self.log, self.version, self.pad_id, self.builder = cfg, log, version, pad_id, builder
        self.timeout = d.timeout_s
        self._actor = ray.remote(RolloutWorker).options(num_cpus=d.cpus_per_worker, num_gpus=d.gpus_per_worker,
                                                         max_restarts=0)
        self._threads = actor_threads(d.cpus_per_worker)
        self._init_ref = ray.put(full_state(policy))
        self._latest_ref = None
        self._acks: list = []
        self.restarts = 0
        self.workers = [self._new() for _ in range(d.rollout_workers)]
        self.sync_bytes = state_bytes(trainable_state(policy))

    def _new(self, job: "Job | None" = None):
        """A fresh worker with the latest weights; given a `job`, with that job's weights first, so it can
        sample the job's shard again (a job in flight while a newer version was sent), then the latest."""
        version, ref = (job.version, job.weights) if job is not None else (self.version, self._latest_ref)
        w = self._actor.remote(self.cfg, self._init_ref, version, self._threads, self.builder)
        if ref is not None:
            w.set_weights.remote(version, ref)
        return w

    def submit(self, examples: list, generator: torch.Generator) -> Job:
        """Start sampling `examples` with the current weights; one base seed drawn from `generator`."""
        self._check_acks()
        base = sampling.draw_base_seed(generator)
        parts = [(w, first, count, self.workers[w].sample.remote(examples[first:first + count], base, first))
                 for w, (first, count) in enumerate(shards(len(examples), len(self.workers)))]
        return Job(examples, base, self.version, parts, time.perf_counter(), self._latest_ref)

    def collect(self, job: Job) -> Groups:
        """The job's groups, merged in prompt order; a dead or silent worker is replaced and its shard
        sampled again (same seed, same rows)."""
        got = [self._get(job, w, first, count, ref) for w, first, count, ref in job.parts]
        return got[0] if len(got) == 1 else merge(got, self.pad_id)

    def _get(self, job: Job, w: int, first: int, count: int, ref) -> Groups:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        for attempt in range(MAX_RETRIES + 1):
            try:
                version, groups = ray.get(ref, timeout=self.timeout)
            except (RayActorError, GetTimeoutError) as e:
                what = "did not answer within distributed.timeout_s" if isinstance(e, GetTimeoutError) else "died"
                if attempt == MAX_RETRIES:
                    raise RunError(f"rollout worker {w} {what} {MAX_RETRIES + 1} times on prompts {first}-"
                                   f"{first + count - 1}; stopping ({type(e).__name__})") from None
                ray.kill(self.workers[w], no_restart=True)
                self.workers[w] = new = self._new(job)
                self.restarts += 1
                self.log(f"rollout worker {w} {what} ({type(e).__name__}); started a new one and sampled its "
                         f"{count} prompts again (same weights, same seeds, same rows)")
                ref = new.sample.remote(job.examples[first:first + count], job.base_seed, first)
                if job.weights is not self._latest_ref:  # then the weights sent since the job started
                    self._acks.append((w, new, new.set_weights.remote(self.version, self._latest_ref)))
                continue
            if version != job.version:
                raise RunError(f"rollout worker {w} sampled with policy version {version}, expected {job.version}")
            return groups
        raise AssertionError("unreachable")

    def sync(self, policy, version: int, wait: bool = True) -> float:
        """Send the trainable weights of `policy` as `version` to every worker; seconds until all loaded
        them. `wait=False` (a sampling call is in flight: the workers load the weights after it) returns
        after the send and checks the loads at the next `submit`."""
        import ray

        t0 = time.perf_counter()
        self._check_acks()
        self._latest_ref = ray.put(trainable_state(policy))
        self.version = version
        self._acks = [(i, w, w.set_weights.remote(version, self._latest_ref)) for i, w in enumerate(self.workers)]
        if wait:
            self._check_acks()
        return time.perf_counter() - t0

    def _check_acks(self) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        acks, self._acks = self._acks, []
        for i, w, ack in acks:
            try:
                ray.get(ack, timeout=self.timeout)
            except (RayActorError, GetTimeoutError) as e:
                if self.workers[i] is not w:  # already replaced while sampling
                    continue
                ray.kill(w, no_restart=True)
                self.workers[i] = self._new()  # built from the initial weights + this sync
                self.restarts += 1
                self.log(f"rollout worker {i} failed its weight sync ({type(e).__name__}); started a new one")

    def close(self) -> None:
        import ray

        for w in self.workers:
            with contextlib.suppress(Exception):
                ray.get(w.close.remote(), timeout=10)
            with contextlib.suppress(Exception):
                ray.kill(w)
        self.workers = []
