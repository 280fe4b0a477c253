"""Speed probes of a built run, for its price: one decode step of the run's own sampling
(`decode_step_seconds`) and the shares of a batch that the probes time where rollout workers or a
learner group split it (the learn stage's probe is rlvr.learn.learn_part_seconds). Timed with
rlvr.machine's harness.
"""

from __future__ import annotations

import math

import torch

from rlvr import config as config_mod, sampling
from rlvr.machine import actor_threads, ordered_pair
from rlvr.models.lean_llama import grouped_layout, LeanCache
from rlvr.setup_types import Setup


DECODE_PROBE_STEPS = 3
"""Decode steps `decode_step_seconds` times first to price a run's sampling."""
DECODE_PROBE_SECONDS = 2.0
"""The least time the decode steps `decode_step_seconds` times should span, where the response bound
allows: a first call whose DECODE_PROBE_STEPS steps took less is followed by one that times as many
steps as that takes at its rate. A shared CPU's speed can move from one second to the next, and a
few steps then measure the moment, not the step."""
DECODE_PROBE_DEPTH = 128
"""The most columns past the prompt `decode_column_seconds` measures a decode step at (its prompt
that much longer); a step's cost grows about linearly with the columns cached, so the slope
measured there prices the rest."""
DECODE_PROBE_RETRIES = 2
"""Timed pairs `decode_column_seconds` adds while the step after the deeper prompt measured no
longer than the step after the run's (noise on a tiny model's millisecond steps)."""


def decode_probe_share(setup: Setup) -> tuple[int, int] | None:
    """(prompts, torch threads) of the sampling call that one decode step of the run is measured on
    (``decode_step_seconds``): the step's P prompts at this process's threads; with rollout workers
    (distributed.rollout_workers = N) the largest worker's share, ceil(P / N) prompts, at a worker's
    threads (``actor_threads`` of distributed.cpus_per_worker): the workers decode
    their shares side by side, so a batch's decode takes the largest share's steps. None where that
    cannot be measured here: workers on a Ray cluster (distributed.address set: other machines), or
    on another kind of device than this process's (a GPU share against a CPU process, or the
    reverse): ``actors_here``."""
    cfg = setup.cfg
    d, P = cfg.distributed, cfg.train.prompts_per_step
    if not d.rollout_workers:
        return P, torch.get_num_threads()
    if not actors_here(d, setup.device):
        return None
    return -(-P // d.rollout_workers), actor_threads(d.cpus_per_worker)


def actors_here(d: config_mod.DistributedConfig, device: torch.device) -> bool:
    """Whether the Ray actors of `d` (rollout workers, learner ranks) run on this machine on this
    process's kind of device, so that a probe here times what they compute: a local Ray (no
    distributed.address) and a GPU share exactly when this process is on a GPU."""
    return not d.address and (d.gpus_per_worker > 0) == (device.type == "cuda")


def learn_probe_share(setup: Setup) -> tuple[int, int] | None:
    """(groups of a minibatch, torch threads) that one gradient step's learn stage is measured on
    (rlvr.learn.learn_part_seconds): the minibatch's ceil(P / minibatches) groups at this process's
    threads; with a learner group (distributed.learners = N) one rank's share, ceil of that / N
    whole groups (rlvr.distributed.learners.shard_rows gives the first ranks one more), at a
    learner actor's threads (``actor_threads``): the ranks compute their shares side by side. None
    where the ranks cannot be timed here (``actors_here``)."""
    cfg = setup.cfg
    d, tc = cfg.distributed, cfg.train
    per_mb = -(-tc.prompts_per_step // tc.minibatches)                  # groups in a minibatch
    if d.learners <= 1:
        return per_mb, torch.get_num_threads()
    if not actors_here(d, setup.device):
        return None
    return -(-per_mb // d.learners), actor_threads(d.cpus_per_worker)


def decode_small_prompts(setup: Setup) -> int:
    """Prompts of the smaller decode step `decode_step_seconds` times for a run priced at an expected
    response length (sampling.expected_response_tokens): a quarter of the measured share's, rounded
    up; 0 (not measured) where the share has a single prompt, or none is measured."""
    share = decode_probe_share(setup)
    if share is None or share[0] < 2:
        return 0
    return -(-share[0] // 4)


def decode_step_seconds(setup: Setup, prompts: int | None = None, depth: int = 0, reserve: int = 0,
                        steps: int = 0) -> float:
    """Seconds of one decode step of this run's sampling, measured on its own policy: the P x G rows
    of a step after a prompt of the longest prompt's length, through `rlvr.sampling.generate` (the
    forward, the tempered log-softmax and the draw) under the run's numerics. P copies of one
    prompt, G samples each: the cache layout of a real step (on the CPU a prompt's G rows share its
    columns, ``LeanCache.repeat_interleave``; one prompt with P x G samples would not take that
    layout). Timed inside one call of b + n tokens (sampling's ``step_times``): its n steps after the
    first b tokens, so neither the call's prefill nor its first decode step (where a sampling call
    pays once for its steps: allocation, the capture of a graphed decode, model.cuda_graphs) is
    counted; b = 2 where responses may have 3 tokens or more, else 1. n = DECODE_PROBE_STEPS, then,
    where those steps spanned less than DECODE_PROBE_SECONDS, a second call with the steps that span
    it at that rate (at most T - b, T the response bound less `depth`; ``probe_steps``), whose step
    time is the one returned. On a GPU each timed call follows a warm-up call of as many tokens (it
    pays for the first kernel choices per cache length, which cost far more than a step). No
    gradient; the run's generators untouched. Each call's cache holds the run's columns (prompt and
    response bound, each row cut after the tokens timed: ``budgets``), so it takes the run's layout
    (``LeanCache``). With rollout workers: a worker's largest share at a worker's threads
    (``decode_probe_share``; this process's threads restored after). 0.0 when the workers' decode
    cannot be measured here (``decode_probe_share`` None) or a response has a single token.
    `prompts`: measure a step of that many prompts instead (G rows each; ``decode_small_prompts``),
    at the same threads. `depth`: the prompt that many columns longer (its cache's columns as many
    more, ``decode_column_seconds``; that many fewer left to decode), and `reserve` columns more in
    its cache (the layout it takes). `steps`: time that many steps (at most T - b) in a single call,
    where the caller knows about how many span DECODE_PROBE_SECONDS (``decode_column_seconds``)."""
    cfg, model, device = setup.cfg, setup.model, setup.device
    T = setup.limits.max_new_tokens - depth          # what a call can decode after the longer prompt
    base = 2 if T >= 3 else 1
    n = min(DECODE_PROBE_STEPS, T - base)
    share = decode_probe_share(setup)
    if share is None or n < 1:
        return 0.0
    Lp = max(1, setup.limits.prompt_tokens)
    prompt = [setup.tokenizer.pad_id] * (Lp + depth)
    P, threads = share
    P = P if prompts is None else prompts
    G = cfg.train.samples_per_prompt

    def generate(tokens: int, step_times: list[float] | None) -> None:
        with torch.no_grad(), setup.numerics.context():
            sampling.generate(model, [prompt] * P, samples_per_prompt=G, max_new_tokens=T,
                              budgets=[tokens] * P, reserve=reserve,
                              temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                              top_k=cfg.sampling.top_k, min_p=cfg.sampling.min_p,
                              eos_id=None, pad_id=setup.tokenizer.pad_id,
                              generators=sampling.prompt_generators(0, 0, P, device=device), step_times=step_times)

    def step_seconds(n: int) -> float:
        if device.type == "cuda":
            generate(base + n, None)
        times: list[float] = []
        generate(base + n, times)                  # a clock reading at each of its base + n steps
        return (times[base - 1 + n] - times[base - 1]) / n

    was, was_threads = model.training, torch.get_num_threads()
    model.eval()
    torch.set_num_threads(threads)
    try:
        if steps:
            return step_seconds(min(steps, T - base))
        step = step_seconds(n)
        more_steps = probe_steps(step, n, T - base)
        if more_steps > n:
            step = step_seconds(more_steps)
    finally:
        model.train(was)
        torch.set_num_threads(was_threads)
    return step


def probe_steps(step_s: float, steps: int, most: int) -> int:
    """Decode steps ``decode_step_seconds`` times in its second call: as many as span
    DECODE_PROBE_SECONDS at `step_s` seconds a step (its first call's `steps` at the least), at most
    `most` (the response bound's)."""
    if step_s <= 0:
        return steps
    return max(steps, min(most, math.ceil(DECODE_PROBE_SECONDS / step_s)))


def decode_column_seconds(setup: Setup, step_s: float) -> float:
    """Seconds more one decode step of the measured rows costs per row for each column a row has
    cached past its prompt (each step's attention reads every cached column of its rows): a step
    measured after a prompt min(T // 2, DECODE_PROBE_DEPTH) columns longer (``decode_step_seconds``
    with ``depth``), less the step after the run's prompt measured again right before it, each in
    one call of the steps that span DECODE_PROBE_SECONDS at `step_s` (``probe_steps``; the pair
    timed again, each one's best kept, while the deeper measured no longer: DECODE_PROBE_RETRIES; a
    machine whose speed drifts between the price's probes would otherwise swamp the difference),
    over the rows and those columns. 0.0 where it is not measured: `step_s` (the run's decode step,
    measured before) 0, fewer than 16 columns of depth, or a lean
    cache (``LeanCache``, on a CPU) in its grouped layout at the run's lengths, where the prompt's
    columns are read once per prompt, so a longer prompt does not stand for longer responses."""
    T, G = setup.limits.max_new_tokens, setup.cfg.train.samples_per_prompt
    depth = min(T // 2, DECODE_PROBE_DEPTH)
    share = decode_probe_share(setup)
    if step_s <= 0 or depth < 16 or share is None:
        return 0.0
    lean = isinstance(setup.model.new_cache(1, 2), LeanCache) and setup.device.type == "cpu"
    Lp = max(1, setup.limits.prompt_tokens)
    if lean and grouped_layout(Lp, T, G):
        return 0.0
    # the deeper prompt leaves fewer columns to decode: as many more reserved, so that the lean cache
    # takes the run's plain layout
    reserve = 0
    if lean and grouped_layout(Lp + depth, T - depth, G):
        reserve = next(r for r in range(1, 64 * T) if not grouped_layout(Lp + depth, T - depth + r, G))
    n = probe_steps(step_s, DECODE_PROBE_STEPS, T)
    base, deep = ordered_pair(lambda: decode_step_seconds(setup, steps=n),
                              lambda: decode_step_seconds(setup, depth=depth, reserve=reserve, steps=n),
                              DECODE_PROBE_RETRIES)
    return max(deep - base, 0.0) / (share[0] * G * depth)
