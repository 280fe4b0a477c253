"""Building a run before any compute, and reloading a finished one.

`build(cfg)` loads the task, the tokenizer and the policy, derives the generation limits (the
response bound, the end token, the longest prompt) and checks them against the model's context,
all before a single token is sampled; `load_run(run_dir)` reloads a run's checkpoint for
`rlvr eval` and `rlvr probe` (a run cut off before its end: its best/ or its last state).

Run directories are data: `refuse_run_task` keeps eval, probe and audit from loading anything but the
project's own task factories (rlvr.tasks.*) when a run directory's config.toml names the task or a
file or module in its options (someone else's run directory would run their code), and
`run_config_guard` holds every import made while the task is built to the same rule, unless the user
names the task again (`--task.path=...`) or passes `--trust-run-config`. Training (rlvr.trainer), evaluation and the probe share these, so
each rule lives in one place.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from rlvr import config as config_mod, costs, losses, sampling
from rlvr.models.lean_llama import bf16_weights, decode_reads_packs
from rlvr.models.tiny import TinyConfig, TinyTransformer
from rlvr.policy import Policy, Tokenizer
from rlvr.state import StateError, find_complete, find_state, load_policy_weights, verify, write_dir_atomically
from rlvr.tasks import (Task, foreign_code, load_task, names_code, project_task_refusal, resolve_weights,
                        split_path, untrusted_config)
from rlvr.tokenizer import CharTokenizer, PromptFormat, encode_examples


class RunError(RuntimeError):
    """A run that cannot start or continue, with the reason."""


@dataclass(frozen=True)
class Limits:
    """How long a response may be and where it ends, for one task on one tokenizer."""

    max_new_tokens: int
    """Response bound: `sampling.max_new_tokens`, or the task's own bound when that is 0."""
    eos_id: int | None
    """The end token; None on fixed-length tasks (exactly max_new_tokens tokens, no end token)."""
    prompt_tokens: int
    """Tokens of the longest prompt, train and held-out (pricing and the context check)."""
    stop: tuple = ()
    """`sampling.stop`: strings that end a response at the token completing one (rlvr.sampling.StopStrings)."""
    tool_calls: int = 0
    """`sampling.max_tool_calls`: the task's tool answers up to this many stop strings per response (rlvr.tools)."""
    tool_role: str = ""
    """`sampling.tool_role`: "" inserts the tool's text as it is; a role, as that role's chat turn."""
    tool_on_end: bool = False
    """`sampling.tool_on_end`: a response that ends at eos calls the tool too (a multi-turn environment)."""


@dataclass
class Setup:
    """Everything a run needs, built and checked before any compute."""

    cfg: config_mod.Config
    task: Task
    tokenizer: Tokenizer
    model: Policy
    reward_weights: dict[str, float]
    limits: Limits
    device: torch.device
    """Where the policy (and the reference) run."""
    baseline_bytes: int = 0
    """This process's resident set just before the policy was loaded (torch, transformers, the
    task): the memory prediction's baseline (rlvr.costs.memory)."""
    numerics: Numerics | None = None
    """How the policy's forwards compute (`model.autocast` resolved at build time); None given = fp32."""

    def __post_init__(self):
        if self.numerics is None:
            self.numerics = Numerics(False, "off", self.device.type)

    @property
    def recompute_logp_old(self) -> bool:
        """Whether logp_old comes from the learner's forward rather than the sampler (`logp_old_source`)."""
        return logp_old_source(self.cfg, self.numerics) == "recompute"

    @property
    def logp_old_from_learner(self) -> bool:
        """Whether that forward is the learn stage's own first one (`logp_old_in_learn`): no extra forward."""
        return self.recompute_logp_old and logp_old_in_learn(self.cfg)


def bf16_forwards(cfg: config_mod.Config, numerics: Numerics) -> bool:
    """Whether the policy's forwards compute in bf16: under bf16 autocast, or a Hugging Face model
    loaded with bf16 weights (model.dtype)."""
    return numerics.bf16 or bool(cfg.model.path) and cfg.model.dtype == "bf16"


def logp_old_source(cfg: config_mod.Config, numerics: Numerics) -> str:
    """algorithm.logp_old resolved: `sampler` or `recompute` as set; `auto` is `recompute` where the
    forwards run in bf16 (`bf16_forwards`: the sampler's decode steps and the training forward then
    round differently, so the sampler's log-probs are not the trainer's), else `sampler`. A resumed
    run, a rollout worker and a learner actor get the same answer: the numerics decision travels."""
    asked = cfg.algorithm.logp_old
    if asked != "auto":
        return asked
    return "recompute" if bf16_forwards(cfg, numerics) else "sampler"


def logp_old_in_learn(cfg: config_mod.Config) -> bool:
    """Whether a recomputed logp_old comes from the learn stage's own forwards, detached, rather than
    a forward of the rollout stage's. With train.minibatches = 1 the first pass computes every row at
    π_old, before any update, so its log-probs are π_old's as the learner computes them (ratio
    exactly 1, as TRL takes `old_per_token_logps` when it updates once) and the batch costs no extra
    forward. With more minibatches the first minibatch's forward gives its rows and the others' rows
    come from forwards over the very parts their updates will run in, before the first update
    (rlvr.learn.prepass_logp_old; in a learner group each rank its own rows, exchanged after the
    first minibatch): each minibatch's first ratio is exactly 1 there too, for (minibatches - 1) /
    minibatches of a forward. The rollout stage still runs one where it needs the numbers before Δ
    (algorithm.top_entropy_quantile < 1, algorithm.kl_in = "reward" with a KL) and for rows sampled
    by older weights (distributed.max_staleness > 0; rlvr.distributed.staleness)."""
    ac = cfg.algorithm
    kl_in_reward = ac.kl_in == "reward" and ac.kl_coef > 0
    return ac.top_entropy_quantile >= 1 and not kl_in_reward and cfg.distributed.max_staleness == 0


def logp_old_note(cfg: config_mod.Config, numerics: Numerics) -> str:
    """What the price says of `algorithm.logp_old = auto`'s choice ("" when it was set)."""
    if cfg.algorithm.logp_old != "auto":
        return ""
    if logp_old_source(cfg, numerics) == "recompute":
        return ("algorithm.logp_old = auto: the forwards run in bf16, where the sampler's log-probs are not "
                "the trainer's")
    return "algorithm.logp_old = auto: fp32 forwards, the sampler's log-probs are the trainer's to rounding"


def actor_threads(cpus: float) -> int:
    """torch threads of an actor given `cpus` (its Ray CPU share): at least 1. A policy running more
    threads than its share fights the other actors for cores and runs many times slower a step
    (docs/distributed.md)."""
    return max(1, int(cpus))


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask; os.cpu_count() where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no affinity mask
        return os.cpu_count() or 1


def oversubscribed(threads: int, load: float, cores: int, what: str | None = None,
                   allowance: float = 1.0) -> str | None:
    """The warning when `threads` more busy threads on top of `load` busy cores exceed `cores` by more
    than `allowance`, else None; `what` says how `load` was measured (default: the 1-minute load
    average). Threads on cores that another process keeps busy wait for each other at every matmul,
    which makes each step many times slower (docs/guide/configs.md, "Threads"). The load average's
    allowance is one core, since it also counts this process's own start-up (the matmul-rate probe,
    building the model: most of a core on an otherwise idle machine, docs/benchmarks.md); a direct measurement that leaves this
    process out needs only half a core."""
    if load + threads <= cores + allowance:
        return None
    fix = (f"lower train.threads (e.g. --train.threads={max(1, int(cores - load))}) or stop the other job"
           if threads > 1 else "stop the other job (this run already uses one thread)")
    what = what or f"1-minute load average {load:.1f}"
    return (f"the machine is oversubscribed: {what} + this run's {threads} threads "
            f"> {cores} cores, so steps may run many times slower; {fix}")


def busy_cores(stat0: str, stat1: str, own_s: float, wall_s: float, hz: int) -> float:
    """Cores kept busy by other processes between two readings of /proc/stat's first ("cpu") line:
    busy time (all fields but idle and iowait; guest time is inside user) over the interval, less
    `own_s` seconds of this process's CPU time, divided by the `wall_s` the interval lasted."""
    def busy(line: str) -> int:
        v = [int(x) for x in line.split()[1:9]]             # user nice system idle iowait irq softirq steal
        return sum(v) - v[3] - v[4]
    return max(0.0, ((busy(stat1) - busy(stat0)) / hz - own_s) / wall_s)


PROC_STAT = "/proc/stat"
"""Where `_proc_stat_busy` reads the machine's CPU times (Linux)."""


def _proc_stat_busy(interval: float = 0.25) -> float | None:
    """`busy_cores` over `interval` seconds from now; None (at once) where `PROC_STAT` cannot be read."""
    try:
        def reading() -> tuple[str, float, float]:
            with open(PROC_STAT) as f:
                return f.readline(), time.process_time(), time.monotonic()
        (s0, p0, t0) = reading()
        time.sleep(interval)
        (s1, p1, t1) = reading()
        return busy_cores(s0, s1, p1 - p0, t1 - t0, os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def busy_elsewhere(interval: float = 0.25) -> tuple[float, str, float] | None:
    """(cores other processes keep busy, how that was measured, the allowance `oversubscribed` gives it):
    /proc/stat over `interval` seconds less this process's own CPU time where there is one (a job that
    ended seconds ago no longer counts), else the 1-minute load average (which does, for up to a
    minute); None where neither exists."""
    now = _proc_stat_busy(interval)
    if now is not None:
        return now, f"other processes kept {now:.1f} cores busy over the last {interval:g} s", 0.5
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    return load, f"1-minute load average {load:.1f}", 1.0


def set_threads(cfg: config_mod.Config) -> tuple[int, str | None]:
    """Apply `train.threads` (0 = the cores this process may use) to torch, once at the start;
    returns (threads, the oversubscription warning or None) for the caller to log before step 1."""
    cores = usable_cores()
    threads = cfg.train.threads or cores
    torch.set_num_threads(threads)
    busy = busy_elsewhere()
    if busy is None:  # nothing measured on this platform: nothing to warn about
        return threads, None
    load, what, allowance = busy
    return threads, oversubscribed(threads, load, cores, what, allowance)


_MATMUL_RATES: dict[tuple[str, int], float] = {}


def matmul_rate(device: torch.device, seconds: float = 1.0) -> float:
    """FLOP/s of fp32 matrix products on `device` at torch's current thread count, measured once
    per process (about `seconds` of square products; a few ms when cached). An upper bound on
    what a model reaches: a small model's products are smaller and sampling adds per-token overhead."""
    key = (str(device), torch.get_num_threads())
    if key not in _MATMUL_RATES:
        n = 2048 if device.type == "cuda" else 512
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        a @ b  # warm-up
        sync()
        count, t0 = 0, time.perf_counter()
        while True:
            a @ b
            count += 1
            sync()
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                break
        _MATMUL_RATES[key] = 2 * n**3 * count / elapsed
    return _MATMUL_RATES[key]


DECODE_PROBE_STEPS = 3
"""Decode steps `decode_step_seconds` times (after a warm-up call) to price a run's sampling."""
DECODE_PROBE_RETRIES = 2
"""Timed pairs `decode_step_seconds` adds while the longer call measured no longer than the shorter
(noise on a tiny model's millisecond calls); if it still does, a step is priced at the longer
call's time over its tokens (prefill included: never 0, an over-estimate)."""


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


def decode_step_seconds(setup: Setup) -> float:
    """Seconds of one decode step of this run's sampling, measured on its own policy: the P x G rows
    of a step after a prompt of the longest prompt's length, through `rlvr.sampling.generate` (the
    forward, the tempered log-softmax and the draw) under the run's numerics. P copies of one
    prompt, G samples each: the cache layout of a real step (on the CPU a prompt's G rows share its
    columns, ``LeanCache.repeat_interleave``; one prompt with P x G samples would not take that
    layout); a warm-up call (on a GPU with as many tokens as the timed one: it pays for its first
    kernel choices per cache length, which cost far more than a step; on a CPU 2 tokens), then b and b +
    DECODE_PROBE_STEPS tokens timed, the difference over DECODE_PROBE_STEPS (the pair timed again,
    each call's best kept, while the difference is not positive: DECODE_PROBE_RETRIES). b = 2 where
    responses may have 3 tokens or more, else 1: a call of 2 tokens decodes one step, so both calls
    pay what a sampling call pays once for its decode steps (the capture of a graphed decode,
    model.cuda_graphs) and the difference is the steps alone. No gradient; the run's generators
    untouched. With rollout workers: a worker's largest share at a worker's threads
    (``decode_probe_share``; this process's threads restored after). 0.0 when the workers' decode
    cannot be measured here (``decode_probe_share`` None) or a response has a single token."""
    cfg, model, device = setup.cfg, setup.model, setup.device
    base = 2 if setup.limits.max_new_tokens >= 3 else 1
    n = min(DECODE_PROBE_STEPS, setup.limits.max_new_tokens - base)
    share = decode_probe_share(setup)
    if share is None or n < 1:
        return 0.0
    prompt = [setup.tokenizer.pad_id] * max(1, setup.limits.prompt_tokens)
    P, threads = share
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(tokens: int) -> float:
        t = time.perf_counter()
        with torch.no_grad(), setup.numerics.context():
            sampling.generate(model, [prompt] * P, samples_per_prompt=cfg.train.samples_per_prompt,
                              max_new_tokens=tokens, temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                              top_k=cfg.sampling.top_k, min_p=cfg.sampling.min_p,
                              eos_id=None, pad_id=setup.tokenizer.pad_id,
                              generators=sampling.prompt_generators(0, 0, P, device=device))
        sync()
        return time.perf_counter() - t

    was, was_threads = model.training, torch.get_num_threads()
    model.eval()
    torch.set_num_threads(threads)
    try:
        timed(base + n if device.type == "cuda" else 2)           # warm-up: allocation, kernel choice
        one, more = timed(base), timed(base + n)
        for _ in range(DECODE_PROBE_RETRIES):   # a busy core can make the longer call the shorter (tiny models)
            if more > one:
                break
            one, more = min(one, timed(base)), min(more, timed(base + n))
    finally:
        model.train(was)
        torch.set_num_threads(was_threads)
    return (more - one) / n if more > one else more / (base + n)


AUTOCAST_MIN_SPEEDUP = 2.0
"""`model.autocast = auto` picks bf16 when the probe product runs at least this many times faster
under it. Far above 1: bf16 changes what a run computes (and so which trajectory a seed follows),
which is worth it only for a clear speed-up; and a threshold far from the ratios CPUs actually
measure keeps the decision from flipping between two starts on one machine (docs/performance.md)."""
AUTOCAST_MIN_HIDDEN = 256
"""`model.autocast = auto` keeps fp32, without timing, for models whose hidden size is below this:
their step is per-operation overhead more than matrix products, so bf16 buys little speed and a
machine-dependent trajectory (docs/performance.md)."""
AUTOCAST_SAMPLE_S = 2e-3
"""Each timed sample of the probe product repeats it for at least this long, so a sample is the
product's warm cost and not a timer tick or a first call's kernel choice."""
_AUTOCAST_TIMINGS: dict[tuple, tuple[float, float]] = {}


def autocast_context(enabled: bool, device_type: str) -> contextlib.AbstractContextManager:
    """torch.autocast to bf16 on `device_type` when `enabled` (with a region of bf16 weight copies on
    the CPU, rlvr.models.lean_llama.bf16_weights), else a context that changes nothing. A new object
    per call (use one per `with`)."""
    if not enabled:
        return contextlib.nullcontext()
    if device_type != "cpu":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return _cpu_bf16()


@contextlib.contextmanager
def _cpu_bf16():
    with torch.autocast("cpu", dtype=torch.bfloat16), bf16_weights():
        yield


def autocast_timings(device: torch.device, rows: int, inner: int, outer: int, budget_s: float = 0.5,
                     rounds: int = 5) -> tuple[float, float]:
    """(fp32 seconds, bf16 seconds) of one warm (rows, inner) x (inner, outer) product as a Linear
    layer computes it (the weight cast to bf16 included), plain and under bf16 autocast on `device`.

    First-call costs are excluded: three untimed calls of each choose the kernels, then each timed
    sample repeats the product for at least AUTOCAST_SAMPLE_S, and the result is the median of
    `rounds` samples of each, alternated (fewer when the budget runs out). Measured once per process
    and thread count."""
    key = (str(device), rows, inner, outer, torch.get_num_threads())
    if key in _AUTOCAST_TIMINGS:
        return _AUTOCAST_TIMINGS[key]
    x, w = torch.randn(rows, inner, device=device), torch.randn(outer, inner, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(bf16: bool, calls: int) -> float:
        with torch.no_grad(), autocast_context(bf16, device.type):
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                torch.nn.functional.linear(x, w)
            sync()
            return (time.perf_counter() - t0) / calls

    start = time.perf_counter()
    warm = (timed(False, 3), timed(True, 3))                     # kernel choice, first casts: not timed
    calls = [max(1, math.ceil(AUTOCAST_SAMPLE_S / max(t, 1e-9))) for t in warm]
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for i, bf16 in enumerate((False, True)):
            samples[i].append(timed(bf16, calls[i]))
        if time.perf_counter() - start > budget_s:
            break
    fp32, bf16 = (statistics.median(s) for s in samples)
    _AUTOCAST_TIMINGS[key] = (fp32, bf16)
    return fp32, bf16


@dataclass(frozen=True)
class Numerics:
    """How the policy's forwards compute (`model.autocast`): fp32, or bf16 products under torch.autocast
    (weights, optimizer and log-softmax stay float32)."""

    bf16: bool
    """True: the forwards run under bf16 autocast."""
    asked: str = "off"
    """model.autocast as configured: auto, bf16 or off."""
    device_type: str = "cpu"
    fp32_s: float = 0.0
    """Measured seconds of the probe product in fp32 (auto only; 0 = not measured)."""
    bf16_s: float = 0.0
    """The same product under bf16 autocast."""
    shape: tuple[int, int, int] = (0, 0, 0)
    """(rows, inner, outer) of the probe product."""

    def context(self) -> contextlib.AbstractContextManager:
        """The context the policy's forwards run in (a new one per call)."""
        return autocast_context(self.bf16, self.device_type)

    def matmul_speedup(self) -> float:
        """fp32 time / bf16 time of the probe product when the run computes in bf16 and it was measured
        (auto, or bf16 set on a fresh run; below 1 where bf16 is slower), so the price's wall-time
        estimate scales the fp32 matmul rate by it; 1.0 otherwise (fp32, or bf16 without a
        measurement: a resumed run, `rlvr eval`)."""
        return self.fp32_s / self.bf16_s if self.bf16 and self.fp32_s > 0 and self.bf16_s > 0 else 1.0

    def describe(self) -> str:
        """One line for the price: what was chosen and why, with both measured times."""
        what = "bf16 autocast" if self.bf16 else "fp32"
        rows, inner, outer = self.shape
        if not self.fp32_s:
            if self.asked == "auto" and inner:
                return (f"{what} (model.autocast = auto: hidden size {inner} < {AUTOCAST_MIN_HIDDEN}, not timed: "
                        f"a model this small is not bound by its products)")
            return f"{what} (model.autocast = {self.asked})"
        speedup = self.fp32_s / self.bf16_s
        auto_bf16 = auto_takes_bf16(self.fp32_s, self.bf16_s, inner)
        why = (f"bf16 needs >= {AUTOCAST_MIN_SPEEDUP}x" if self.asked == "auto" else
               "as set" + (("; slower than fp32" if speedup < 1 else "") + "; model.autocast = auto would take fp32 here"
                           if not auto_bf16 else ""))
        return (f"{what} (model.autocast = {self.asked}: bf16 {speedup:.2f}x fp32 here, "
                f"{self.bf16_s * 1e3:.3g} ms against {self.fp32_s * 1e3:.3g} ms for a {rows} x {inner} x {outer} "
                f"product; {why})")


def auto_takes_bf16(fp32_s: float, bf16_s: float, hidden: int) -> bool:
    """The rule of `model.autocast = auto`: bf16 for a model of hidden size at least
    AUTOCAST_MIN_HIDDEN whose probe product runs at least AUTOCAST_MIN_SPEEDUP times faster in it."""
    return hidden >= AUTOCAST_MIN_HIDDEN and fp32_s >= AUTOCAST_MIN_SPEEDUP * bf16_s


def choose_numerics(mode: str, device: torch.device, shape: tuple[int, int, int],
                    time_bf16: bool = False) -> Numerics:
    """`model.autocast` resolved: `bf16` and `off` as said; `auto` keeps fp32 untimed below
    AUTOCAST_MIN_HIDDEN (the probe's inner size), else times one (rows, inner, outer) product with
    `autocast_timings` and applies `auto_takes_bf16`. `time_bf16` (a fresh run's price): `bf16` is
    timed too, and kept whatever the times say, so the price's wall time is at the rate bf16 runs at
    here and its line says when bf16 is the slower one."""
    if mode == "off" or (mode == "bf16" and not time_bf16):
        return Numerics(mode == "bf16", mode, device.type)
    if mode == "auto" and shape[1] < AUTOCAST_MIN_HIDDEN:
        return Numerics(False, mode, device.type, shape=tuple(shape))
    fp32_s, bf16_s = autocast_timings(device, *shape)
    bf16 = mode == "bf16" or auto_takes_bf16(fp32_s, bf16_s, shape[1])
    return Numerics(bf16, mode, device.type, fp32_s, bf16_s, tuple(shape))


def eval_numerics(cfg: config_mod.Config, model: Policy, recorded: str | None) -> Numerics:
    """What `rlvr eval` samples a finished run's model under: `recorded`, the decision the run took when
    it started (model.autocast = auto; rlvr.rundir.RunDir.recorded_autocast), so the evaluation
    computes as the run's own evaluations did; else model.autocast as configured (auto measured now)."""
    device = next(iter(model.parameters())).device
    asked = (recorded if cfg.model.autocast == "auto" else None) or cfg.model.autocast
    return choose_numerics(asked, device, probe_shape(model, device))


def probe_shape(model: Policy, device: torch.device) -> tuple[int, int, int]:
    """(rows, inner, outer) of the autocast probe: 256 token rows (4096 on a GPU, where small products
    time only the launch) x the hidden size x the MLP width of `model` (1024 x 1024 when unknown)."""
    rows = 256 if device.type == "cpu" else 4096
    shape = model_shape(model)
    return (rows, shape.hidden, shape.mlp) if shape is not None else (rows, 1024, 1024)


def check_group_by(cfg: config_mod.Config, task: Task) -> None:
    """RunError when eval.group_by names a key no held-out example's meta has (listing those it has)."""
    key = cfg.eval.group_by
    metas = [ex.meta for ex in task.heldout if isinstance(ex.meta, dict)]
    if key and not any(key in m for m in metas):
        keys = sorted({k for m in metas for k in m})
        raise RunError(f"eval.group_by = {key!r}: no held-out example of the task {task.name!r} has it in its meta "
                       f"(their keys: {', '.join(keys[:20]) or 'none'})")


def reward_weights(cfg: config_mod.Config, task: Task) -> dict[str, float]:
    """{reward name: weight} the run optimises; names checked against the task."""
    return resolve_weights(task, cfg.task.reward, cfg.task.reward_weights)


def resolve_device(name: str) -> torch.device:
    """`train.device`: cpu, cuda, cuda:N, mps, or auto (cuda when available, else cpu)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise RunError(f"train.device = {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RunError(f"train.device = {name!r}, but this torch sees no CUDA device (use cpu or auto)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise RunError(f"train.device = {name!r}, but MPS is not available here")
    return device


def limits(cfg: config_mod.Config, task: Task, tok: Tokenizer, model: Policy | None = None,
           examples: list | None = None) -> Limits:
    """The generation limits of `task` on `tok`, checked against `model`'s context when given.

    `examples` (default: every train and held-out example) are the prompts measured. Raises
    RunError naming the longest prompt when prompt + response cannot fit the model."""
    examples = list(task.heldout) + list(task.train) if examples is None else examples
    max_new = cfg.sampling.max_new_tokens or task.max_new_tokens
    try:
        lengths = [len(ids) for ids in encode_examples(tok, examples)]
    except ValueError as e:
        raise RunError(f"the model's tokenizer cannot encode the task's prompts: {e}") from None
    n = max(lengths)
    block = model.config.block_size if model is not None else None
    if block and n + max_new > block:
        longest = examples[lengths.index(n)]
        raise RunError(f"task prompt {longest.prompt[:60]!r} has {n} tokens; with max_new_tokens = {max_new} that "
                       f"exceeds the model's context of {block} tokens ({cfg.model.path or cfg.model.init or 'built-in'})")
    if cfg.sampling.stop and task.fixed_length:
        raise RunError(f"sampling.stop = {cfg.sampling.stop!r}, but the task's responses have a fixed length "
                       f"({max_new} tokens, no end token): there is nothing to stop early")
    if cfg.sampling.tool_on_end and task.fixed_length:
        raise RunError("sampling.tool_on_end = true, but the task's responses have a fixed length (no end token)")
    if cfg.sampling.max_tool_calls and task.tool is None:
        raise RunError(f"sampling.max_tool_calls = {cfg.sampling.max_tool_calls}, but the task {task.name!r} has no "
                       "tool (Task.tool) to call")
    role = cfg.sampling.tool_role
    if role and cfg.sampling.max_tool_calls:
        why = "" if tok.has_chat_template else "the tokenizer has no chat template"
        if not why:
            try:
                tok.turn_text(role, "42")
            except Exception as e:  # noqa: BLE001 - a template that cannot render the turn (jinja's errors too)
                why = f"{type(e).__name__}: {e}"
        if why:
            raise RunError(f"sampling.tool_role = {role!r} needs a chat template that renders a {role!r} turn after "
                           f"the assistant's: {why} (tool_role = \"\" inserts the tool's text as it is)")
    return Limits(max_new, None if task.fixed_length else tok.eos_id, n, tuple(cfg.sampling.stop),
                  cfg.sampling.max_tool_calls, role, cfg.sampling.tool_on_end)


def _hf_policy(cfg: config_mod.Config, device: torch.device, log) -> tuple[Policy, Tokenizer]:
    from rlvr.models.hf import LoraSpec, load_policy

    from rlvr.models.hf_source import LoraTargetsError

    mc = cfg.model
    targets = list(mc.lora_target_modules)
    lora = LoraSpec(r=mc.lora_r, alpha=mc.lora_alpha, dropout=mc.lora_dropout,
                    target_modules="all-linear" if targets == ["all-linear"] else targets or None) if mc.lora_r else None
    try:  # a new adapter's random init drawn from train.seed, not from whatever ran before in this process
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(cfg.train.seed)
            model, tokenizer = load_policy(mc.path, dtype=mc.dtype, lora=lora, device=device)
    except LoraTargetsError as e:
        raise RunError(f"model.lora_target_modules = {targets!r} (model.path = {mc.path!r}): {e}; "
                       f"e.g. --model.lora_target_modules='[\"all-linear\"]'") from None
    except ValueError as e:
        raise RunError(f"model.path = {mc.path!r}: {e}") from None
    if model.load_note:
        log(f"note: {model.load_note}")
    if mc.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    model.cuda_graphs = mc.cuda_graphs
    model.compile_layers = mc.compile
    if mc.compile:
        log(f"note: {compile_note(model)}")
    return model, tokenizer


def compile_note(model) -> str:
    """What model.compile acts on for ``model`` (an HFPolicy): how many decoder layers it compiles,
    or why none (the transformers forward, layers not of the Llama type, gradient checkpointing)."""
    from rlvr.models.lean_llama import compiled_plan

    if model.fast_unsupported is not None:
        return f"model.compile: this model runs transformers' forward ({model.fast_unsupported}); nothing is compiled"
    if model.gradient_checkpointing:
        return "model.compile: with model.gradient_checkpointing the layers run eagerly; nothing is compiled"
    layers = model._hf_model().model.layers
    n = sum(compiled_plan(layer) is not None for layer in layers)
    if n == 0:
        return (f"model.compile: none of the {len(layers)} decoder layers is of the Llama type the compiled "
                f"layers cover; they run eagerly")
    return (f"model.compile: {n} of {len(layers)} decoder layers and the token log-probs run compiled in "
            f"prefills and training and scoring forwards (decode steps eager); compiling takes tens of "
            f"seconds at the first training step and the first prefill, which the price's wall time leaves out")


def prompt_format(cfg: config_mod.Config, task: Task, tok: Tokenizer, log=print) -> PromptFormat:
    """`task.chat` and `task.system` as the run's PromptFormat (rlvr.tokenizer.encode_example), checked
    against the tokenizer: RunError for `user` or a system message without a chat template (a system
    message under `off` is refused with the config); a note when plain prompts go past a chat
    template (`messages`)."""
    tc = cfg.task
    where = f"model.path = {cfg.model.path!r}" if cfg.model.path else "the built-in model"
    if not tok.has_chat_template and (tc.chat == "user" or tc.system):
        key = "task.chat = 'user'" if tc.chat == "user" else "task.system"
        raise RunError(f"{key} needs a tokenizer with a chat template; {where}'s has none")
    first = task.train[0] if len(task.train) else task.heldout[0]
    plain = not (isinstance(first.meta, dict) and first.meta.get("messages"))
    if tc.chat == "messages" and tok.has_chat_template and plain:
        log("note: the task's prompts are plain text and go to the model as they are, without its chat "
            "template; --task.chat=user sends each as a user turn through the template")
    return PromptFormat(chat=tc.chat, system=tc.system)


def _built_in(cfg: config_mod.Config, task: Task) -> tuple[Policy, Tokenizer]:
    """The built-in model: from `model.init`, or random with a block sized to the task."""
    if cfg.model.init:
        init = Path(cfg.model.init)
        if not (init / "model.safetensors").is_file() or not (init / "tokenizer.json").is_file():
            raise RunError(f"model.init = {cfg.model.init!r}: expected model.safetensors and tokenizer.json there")
        try:
            tok = CharTokenizer.load(init / "tokenizer.json")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RunError(f"model.init: {init / 'tokenizer.json'}: unreadable ({type(e).__name__}: {e})") from None
        try:
            return TinyTransformer.from_pretrained(init), tok
        except Exception as e:  # safetensors raises its own SafetensorError on a damaged file
            raise RunError(f"model.init: {init / 'model.safetensors'} (or its config.json): unreadable "
                           f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
    examples = list(task.train) + list(task.heldout)
    alphabet = task.alphabet or "".join(sorted({c for ex in examples for c in ex.prompt + str(ex.answer)}))
    tokenizer = CharTokenizer(alphabet)
    n = max(len(tokenizer.encode(ex.prompt)) for ex in examples)
    config_mod.check_against_task(cfg, train_prompts=len(task.train), prompt_tokens=n,
                                  max_new_tokens=cfg.sampling.max_new_tokens or task.max_new_tokens)
    torch.manual_seed(cfg.train.seed)
    model = TinyTransformer(TinyConfig(
        vocab_size=tokenizer.vocab_size, n_layer=cfg.model.n_layer, n_head=cfg.model.n_head,
        n_embd=cfg.model.n_embd, block_size=n + (cfg.sampling.max_new_tokens or task.max_new_tokens) + 1,
    ))
    return model, tokenizer


def _import_optimizer_modules() -> None:
    """Construct a throwaway AdamW: its constructor imports torch._dynamo and friends (about 800
    modules, some 70 MB resident), which every run loads when it builds its optimizer; done before
    the memory baseline is read, so the baseline counts them."""
    with contextlib.suppress(Exception):
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True)


def build(cfg: config_mod.Config, log=print, autocast: str | None = None, time_bf16: bool = False) -> Setup:
    """Load the task, build tokenizer and model; every error here comes before any compute.
    `autocast` ("bf16" or "off") replaces model.autocast's choice (a resumed run keeps its first decision).
    `time_bf16`: a model.autocast = bf16 is timed against fp32 too (a fresh run's price, `rlvr price`)."""
    device = resolve_device(cfg.train.device)
    task = load_task(cfg.task.path, **cfg.task.options)
    config_mod.check_against_task(cfg, train_prompts=len(task.train), prompt_tokens=0,
                                  max_new_tokens=cfg.sampling.max_new_tokens or task.max_new_tokens,
                                  fixed_length=task.fixed_length)
    weights = reward_weights(cfg, task)
    check_group_by(cfg, task)
    if cfg.model.path:  # their import is part of the process's baseline, not of the model
        with contextlib.suppress(ImportError):
            import peft  # noqa: F401
            import transformers  # noqa: F401
    _import_optimizer_modules()
    baseline = costs.resident_bytes()
    model, tokenizer = _hf_policy(cfg, device, log) if cfg.model.path else _built_in(cfg, task)
    tokenizer.prompt_format = prompt_format(cfg, task, tokenizer, log)
    lim = limits(cfg, task, tokenizer, model)
    numerics = choose_numerics(autocast or cfg.model.autocast, device, probe_shape(model, device),
                               time_bf16=time_bf16 and autocast is None)
    return Setup(cfg, task, tokenizer, model.to(device), weights, lim, device, baseline, numerics)


def model_shape(model: Policy) -> costs.ModelShape | None:
    """The dimensions rlvr.costs.memory needs, from the built-in model's or a Hugging Face model's
    config (None when they cannot be read)."""
    c = model.config
    if isinstance(c, TinyConfig):
        return costs.ModelShape(layers=c.n_layer, hidden=c.n_embd, mlp=c.mlp_ratio * c.n_embd, heads=c.n_head,
                                kv_heads=c.n_head, head_dim=c.n_embd // c.n_head, vocab=c.vocab_size)
    hf = getattr(c, "hf", None)
    hf = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    try:
        heads = hf.num_attention_heads
        return costs.ModelShape(
            layers=hf.num_hidden_layers, hidden=hf.hidden_size, mlp=getattr(hf, "intermediate_size", None)
            or 4 * hf.hidden_size, heads=heads, kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads, vocab=hf.vocab_size,
            checkpointed=bool(getattr(model, "gradient_checkpointing", False)))
    except (AttributeError, TypeError):
        return None


def priced_chunk_rows(setting: int, shape: costs.ModelShape | None) -> int:
    """``model.logprob_chunk_rows`` as the memory price counts it (CPU runs, where ``shape`` is
    known): -1 (auto) -> rlvr.losses.auto_chunk_rows for the vocabulary, else the setting."""
    if setting != -1:
        return setting
    return losses.auto_chunk_rows(shape.vocab, "cpu") if shape is not None else 0


def eval_rows(setup: Setup) -> int:
    """Rows one evaluation decode holds at once: greedy, min(prompts, eval.batch_size); pass@k,
    k per prompt for eval.batch_size // k prompts (rlvr.evaluate)."""
    ec = setup.cfg.eval
    prompts = min(ec.prompts or len(setup.task.heldout), len(setup.task.heldout))
    rows = min(prompts, max(1, ec.batch_size))
    if ec.pass_k:
        rows = max(rows, min(prompts, ec.pass_k_prompts, max(1, ec.batch_size // ec.pass_k)) * ec.pass_k)
    return rows


def price_of(setup: Setup, rate: float | None = None, decode_s: float | None = None,
             learn_s: tuple[float, float] | None = None, learn_probe=None) -> costs.Price:
    """The price of the run `setup` describes (rlvr.costs), before it starts, with a wall-time
    estimate against `rate` FLOP/s (default: `matmul_rate` measured on the run's device) and an
    expected wall time with every decode step at `decode_s` seconds (default: `decode_step_seconds`
    measured on the run's policy) and the learn stage at `learn_s` (a part's forward and backward,
    an optimizer step; default: `learn_probe(setup)`, rlvr.learn.learn_part_seconds as the trainer
    and `rlvr price` pass it, called only where the run's predicted memory fits, `check_memory` and
    `check_device_memory`, so a run that will be refused computes nothing more; without a probe, or
    (0, 0): the training FLOPs at the rate). `train.price_probes = false` runs neither default probe:
    no decode step measured, so no expected wall time, only the FLOP lower bound. Its memory
    baseline is the larger of the resident set before the policy was loaded (`setup.baseline_bytes`)
    and the resident set now less the policy's weights (what was loaded since: tokenizer, imports)."""
    cfg, model = setup.cfg, setup.model
    fwd, trn = costs.model_flops_per_token(model, setup.limits.prompt_tokens, setup.limits.max_new_tokens)
    bytes_per_param = 2 if cfg.model.path and cfg.model.dtype == "bf16" else 4
    on_cpu = setup.device.type == "cpu"
    speedup = setup.numerics.matmul_speedup()       # the wall-time estimate at the rate the run computes at
    kept_copies, phase_copies = (bf16_copy_bytes(model, cfg.algorithm.kl_coef > 0 and not model.has_adapter)
                                 if on_cpu and setup.numerics.bf16 else (0, 0))
    baseline = max(setup.baseline_bytes,
                   costs.resident_bytes() - (model.num_params() * bytes_per_param if on_cpu else 0))
    shape = model_shape(model) if on_cpu else None
    run_shape = costs.RunShape(
        prompts_per_step=cfg.train.prompts_per_step, samples_per_prompt=cfg.train.samples_per_prompt,
        max_new_tokens=setup.limits.max_new_tokens,
        prompt_tokens=setup.limits.prompt_tokens,
        steps=cfg.train.steps, epochs_per_batch=cfg.train.epochs_per_batch, minibatches=cfg.train.minibatches,
        micro_batches=cfg.train.micro_batches, n_params=model.num_params(), has_reference=cfg.algorithm.kl_coef > 0,
        trainable_params=sum(p.numel() for p in model.trainable_params()),
        reference_is_adapter_off=model.has_adapter,
        shared_prompt=shares_prompt(cfg, model),
        bytes_per_param=bytes_per_param,
        flops_fwd_per_token=fwd, flops_train_per_token=trn,
        sampling_rounds=cfg.algorithm.dynamic_sampling_rounds if cfg.algorithm.dynamic_sampling else 1,
        recompute_logp_old=setup.recompute_logp_old and not setup.logp_old_from_learner,
        logp_old_from_learner=setup.logp_old_from_learner, logp_old_note=logp_old_note(cfg, setup.numerics),
        entropy_forward=cfg.algorithm.top_entropy_quantile < 1, tool_calls=setup.limits.tool_calls,
    )
    measured = costs.Measured(
        matmul_flops_per_s=(matmul_rate(setup.device) if rate is None else rate) * speedup,
        matmul_kind="bf16 autocast" if speedup != 1.0 else "fp32", threads=torch.get_num_threads(),
        decode_step_s=(decode_step_seconds(setup) if cfg.train.price_probes else 0.0) if decode_s is None else decode_s,
        numerics=setup.numerics.describe(),
    )
    so = scale_out(setup)
    mem = None if shape is None else costs.MemoryInputs(
        shape, baseline_bytes=baseline, logprob_chunk_rows=priced_chunk_rows(cfg.model.logprob_chunk_rows, shape),
        logit_bytes=2 if bf16_forwards(cfg, setup.numerics) else 4, eval_rows=eval_rows(setup),
        export_copy=model.has_adapter, kept_copy_bytes=kept_copies, weight_copy_bytes=phase_copies,
    )
    first = costs.price(run_shape, measured, mem, so)
    if learn_s is None and learn_probe is not None and cfg.train.price_probes:
        try:
            check_memory(cfg, first)
            check_device_memory(cfg, first, setup.device)
        except RunError:
            return first       # refused by the caller's checks; nothing more is computed
        learn_s = learn_probe(setup) if first.wall_seconds_expected else (0.0, 0.0)
    if learn_s is None or not learn_s[0]:
        return first
    return costs.price(run_shape, measured.with_learn(*learn_s), mem, so)


def scale_out(setup: Setup) -> costs.ScaleOut:
    """What the price needs of the run's rollout workers and learner group (rlvr.distributed)."""
    d, model = setup.cfg.distributed, setup.model
    return costs.ScaleOut(
        rollout_workers=d.rollout_workers, learner_ranks=d.learners,
        decode_share=decode_probe_share(setup) if d.rollout_workers else None,
        learn_share=learn_probe_share(setup) if d.learners > 1 else None,
        sync_bytes=(sum(p.numel() * p.element_size() for _, p in model.named_parameters() if p.requires_grad)
                    if d.rollout_workers else 0))   # rlvr.distributed.sync.trainable_state's bytes


def bf16_copy_bytes(model, reference_copy: bool) -> tuple[int, int]:
    """(bytes kept for the whole run, bytes held in each forward phase) of the bf16 weight copies of
    CPU bf16 autocast (rlvr.models.lean_llama.bf16_weights): 2 a frozen parameter kept, twice that
    where decode reads them prepacked too (lean_llama.decode_reads_packs), 2 a parameter of a
    `reference_copy` kept; 2 a trainable parameter in each forward phase."""
    trainable = sum(p.numel() for p in model.trainable_params())
    frozen = model.num_params() - trainable
    kept = 2 * frozen * (2 if decode_reads_packs() else 1) + (2 * model.num_params() if reference_copy else 0)
    return kept, 2 * trainable


def check_memory(cfg: config_mod.Config, price: costs.Price, available: int | None = None) -> None:
    """Refuse (RunError naming the numbers) a run whose predicted peak (`price.memory_peak_bytes`)
    needs more memory than the machine has available (MemAvailable; `available` overrides it).
    What the process already holds (the baseline and the loaded policy) is not asked for again.
    `train.memory_check = false` turns the check off; so does a price without a memory prediction."""
    if not cfg.train.memory_check or not price.memory_peak_bytes:
        return
    available = costs.available_bytes() if available is None else available
    if available is None:
        return
    held = price.memory_baseline_bytes + price.policy_bytes
    needed = price.memory_peak_bytes - held
    if needed > available:
        gib = 1 / 2**30
        raise RunError(
            f"this run needs about {price.memory_peak_bytes * gib:.2f} GiB at its peak (during "
            f"{price.memory_peak_phase}; {held * gib:.2f} GiB already held, {needed * gib:.2f} GiB more), but the "
            f"machine has {available * gib:.2f} GiB available (MemAvailable).{_parts_that_fit(cfg, price, held + available)}"
            f" Lower train.prompts_per_step, train.samples_per_prompt or sampling.max_new_tokens, raise "
            f"train.micro_batches (the same update) or train.minibatches, set model.logprob_chunk_rows"
            f"{', model.gradient_checkpointing = true' if cfg.model.path and not cfg.model.gradient_checkpointing else ''}"
            f", or set train.memory_check = false to start anyway ({price.memory_line()})")


def _parts_that_fit(cfg: config_mod.Config, price: costs.Price, limit: int) -> str:
    """A sentence naming the fewest train.micro_batches whose predicted peak fits under `limit` bytes,
    when training is the phase that does not fit and some count (whole groups a part) does; else ""."""
    t = cfg.train
    if price.memory_peak_phase != "training":
        return ""
    for k in range(t.micro_batches + 1, t.prompts_per_step // t.minibatches + 1):
        peak = price.peak_in_parts(k / t.micro_batches)
        if peak <= limit:
            return (f" With train.micro_batches = {k} (the same update, {k} forward/backward parts a minibatch) "
                    f"the predicted peak is {peak / 2**30:.2f} GiB, which fits.")
    return ""


def cuda_free_bytes(device: torch.device) -> int:
    """Bytes a new allocation on CUDA `device` can get: the driver's free memory plus what torch's
    caching allocator has reserved and is not using."""
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_device_memory(cfg: config_mod.Config, price: costs.Price, device: torch.device,
                        free: int | None = None) -> None:
    """On a GPU (where the price predicts no peak: `check_memory` covers the CPU's resident set),
    refuse (RunError naming the numbers) a run whose copies allocated after the policy loaded do not
    fit the device's free memory (`free` overrides the measurement, `cuda_free_bytes`): the
    reference copy (KL on without LoRA), AdamW's two moments and the gradients, 16 bytes per
    trainable parameter with the reference, all held from the first update on. Activations, logits
    and the KV cache come on top and are not predicted here, so passing this check is no promise.
    Under `distributed.sharding = fsdp2` with N learners each GPU holds 1/N of these. Other devices,
    and `train.memory_check = false`, skip it."""
    if not cfg.train.memory_check or device.type != "cuda":
        return
    free = cuda_free_bytes(device) if free is None else free
    gradients = price.optimizer_bytes // 2                       # 4 bytes per trainable parameter; AdamW holds 8
    later = price.reference_bytes + price.optimizer_bytes + gradients
    dc = cfg.distributed
    if dc.sharding == "fsdp2" and dc.learners > 1:
        later //= dc.learners
    if later > free:
        gib = 1 / 2**30
        raise RunError(
            f"train.device = {device}: this run allocates {later * gib:.2f} GiB more on the GPU by its first update "
            f"(reference copy {price.reference_bytes * gib:.2f} + AdamW moments {price.optimizer_bytes * gib:.2f} + "
            f"gradients {gradients * gib:.2f} GiB; activations, logits and the KV cache come on top), but only "
            f"{free * gib:.2f} GiB are free there (policy {price.policy_bytes * gib:.2f} GiB already loaded). "
            "Train a LoRA adapter (model.lora_r), set model.dtype = bf16, use a GPU with more memory or shard "
            "over several (distributed.sharding = fsdp2), or set train.memory_check = false to start anyway")


def shares_prompt(cfg: config_mod.Config, model: Policy) -> bool:
    """True when log-prob forwards run each prompt once per group (`model.share_prompt_forward` on a
    model whose cache is differentiable)."""
    return cfg.model.share_prompt_forward and model.differentiable_cache


def save_checkpoint(run_dir: Path, model: Policy, tok: Tokenizer, tag: int = 0) -> None:
    """Built-in model: RUN_DIR/checkpoint (safetensors, config, tokenizer JSON). Hugging Face model:
    RUN_DIR/hf, a plain transformers directory (LoRA merged in; the adapter also in hf/adapter).
    Written beside the old copy, fsynced and renamed into place (rlvr.state.atomic_dir)."""
    if isinstance(model, TinyTransformer):
        def write(d: Path) -> None:
            model.save_pretrained(d)
            tok.save(d / "tokenizer.json")
        write_dir_atomically(run_dir, "checkpoint", tag, write)
    else:
        from rlvr.models.hf import export_hf

        write_dir_atomically(run_dir, "hf", tag, lambda d: export_hf(model, tok, d))


def is_run_dir(d: Path) -> bool:
    """A folder `rlvr train` wrote (config.toml beside price.json or metrics.jsonl), or its best/."""
    d = Path(d)
    return (d / "config.toml").is_file() and any((d / f).is_file() for f in ("price.json", "metrics.jsonl", "best.json"))


RUN_CONFIG = "config.toml"
"""The name of the config `rlvr train` writes into a run directory."""


def is_run_config(config_file: Path) -> bool:
    """True when a config the user points probe or audit at is to be read as a run directory's (data):
    it is named config.toml (what `rlvr train` writes, and what a copied run directory holds) or sits
    beside a file rlvr writes into a run (price.json, metrics.jsonl, best.json, summary.json)."""
    config_file = Path(config_file)
    beside = ("price.json", "metrics.jsonl", "best.json", "summary.json")
    return config_file.name == RUN_CONFIG or any(os.path.lexists(config_file.parent / f) for f in beside)


def _user_options(overrides: Sequence[str]) -> set[str] | None:
    """The top-level `task.options` keys the command line sets (`--task.options.KEY=...`); None when it
    replaces the whole table (`--task.options=...`)."""
    keys: set[str] = set()
    for o in overrides:
        name = o.split("=", 1)[0]
        if name == "--task.options":
            return None
        if name.startswith("--task.options."):
            keys.add(name[len("--task.options."):].split(".")[0])
    return keys


def _options_key(key: str) -> str:
    """The top-level option of a `foreign_code` key: "task.options.rewards[1].path" -> "rewards"."""
    return key[len("task.options."):].split(".")[0].split("[")[0]


def _user_named(cfg: config_mod.Config, overrides: Sequence[str]) -> tuple[bool, set[str] | None]:
    """(the command line names the task path, the options it sets: see `_user_options`)."""
    return any(o.startswith("--task.path=") for o in overrides), _user_options(overrides)


def refuse_run_task(cfg: config_mod.Config, config_file: Path, *, overrides: Sequence[str] = (),
                    trusted: bool = False) -> None:
    """RunError, before anything is imported, when `cfg` (read from a run directory's `config_file`, or
    any config the user did not pass as their own) names code other than the project's own task
    factories: a run directory is data, and its config could name any module, file or builtin.

    The task path must be `rlvr.tasks.NAME:factory` (a function defined there returning a Task, or a Task
    value: `rlvr.tasks.project_task_refusal`) unless the user names it again (`--task.path=...`); no string
    in `task.options` may name a Python file or a `module:NAME` outside rlvr.tasks
    (`rlvr.tasks.foreign_code`) unless the user sets that option (`--task.options...`). `trusted`
    (`--trust-run-config`) lifts both. The error names the key and the file."""
    if trusted:
        return
    path_given, keys = _user_named(cfg, overrides)
    hint = ("a run directory is data, so its config may name only the project's task factories (rlvr.tasks.*) "
            "unless you say so (a copied run directory could run anything)")
    if not path_given:
        why = project_task_refusal(cfg.task.path)
        if why is not None:
            raise RunError(f"{config_file}: task.path {why}; {hint}. Pass --task.path={cfg.task.path} to load it "
                           f"anyway (or another task), or --trust-run-config")
    for key, value in foreign_code(cfg.task.options):
        top = _options_key(key)
        if keys is None or top in keys:
            continue
        raise RunError(f"{config_file}: {key} = {value!r} names code outside the project's task modules; {hint}. "
                       f"Set --task.options.{top}=... yourself, or pass --trust-run-config")


def run_config_guard(cfg: config_mod.Config, config_file: Path, *, overrides: Sequence[str] = (),
                     trusted: bool = False) -> contextlib.AbstractContextManager:
    """The block in which a run directory's task is loaded (`rlvr.tasks.untrusted_config`): every import by
    name made while the task is built (a mixture's components, a dataset task's rewards) must be a module
    of rlvr.tasks, or what the command line itself named. No restriction when `trusted`."""
    if trusted:
        return contextlib.nullcontext()
    path_given, keys = _user_named(cfg, overrides)
    allow = {split_path(cfg.task.path)[0]} if path_given else set()
    for key, value in foreign_code(cfg.task.options):
        if keys is None or _options_key(key) in keys:
            allow.add(names_code(value))
    return untrusted_config(str(config_file), allow=sorted(allow))


def _checkpoint(d: Path, cfg: config_mod.Config) -> tuple[Policy, Tokenizer]:
    """The policy and tokenizer saved in `d` (checkpoint/ or hf/); RunError naming a missing or damaged file."""
    try:
        verify(d)
    except StateError as e:
        raise RunError(str(e)) from None
    if cfg.model.path:
        from rlvr.models.hf import load_policy

        if not (d / "config.json").is_file():
            raise RunError(f"{d / 'config.json'} is missing")
        try:
            return load_policy(d, dtype=cfg.model.dtype)
        except Exception as e:  # transformers / safetensors raise many kinds on a damaged file
            raise RunError(f"{d}: cannot load the checkpoint ({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
    for need in (d / "model.safetensors", d / "config.json", d / "tokenizer.json"):
        if not need.is_file():
            raise RunError(f"{need} is missing")
    try:
        tok = CharTokenizer.load(d / "tokenizer.json")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RunError(f"{d / 'tokenizer.json'}: unreadable ({type(e).__name__}: {e})") from None
    try:
        return TinyTransformer.from_pretrained(d), tok
    except Exception as e:  # safetensors raises its own SafetensorError on a truncated file
        raise RunError(f"{d / 'model.safetensors'} (or {d / 'config.json'}): unreadable "
                       f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None


def load_run(run_dir: Path, overrides: Sequence[str] = (), *, trusted: bool = False,
             note=lambda msg: None) -> tuple[config_mod.Config, Policy, Tokenizer]:
    """Reload a run: (resolved config, model, tokenizer). The final checkpoint/ or hf/; for a run cut
    off before its end, best/ (the best held-out goal so far) or else the last saved state/ (which
    rebuilds the model from the config, so a task file is imported only under `refuse_run_task`'s
    rule); `note` is told which. `overrides` are --section.key=value applied to the run's config."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise RunError(f"{run_dir} is not a finished run: {run_dir / 'config.toml'} is missing")
    cfg = config_mod.load(run_dir / "config.toml", list(overrides))
    name = "hf" if cfg.model.path else "checkpoint"
    final = find_complete(run_dir, name)
    if final is not None:
        return (cfg, *_checkpoint(final, cfg))
    best = find_complete(run_dir, "best")
    if best is not None and find_complete(best, name) is not None:
        try:
            info = json.loads((best / "best.json").read_text())
            what = f" (step {info['step']}, eval/goal {info['eval/goal']:.4g})"
        except (OSError, ValueError, KeyError, TypeError):
            what = ""
        note(f"{run_dir} has no final {name}/ (the run was cut off); loading best/{what}")
        return (cfg, *_checkpoint(find_complete(best, name), cfg))
    if find_state(run_dir) is None:
        need = run_dir / name / ("config.json" if cfg.model.path else "model.safetensors")
        raise RunError(f"{run_dir} is not a finished run and holds nothing to load: {need} is missing, and there "
                       f"is no best/ or state/ (the run stopped before its first save)")
    refuse_run_task(cfg, run_dir / "config.toml", overrides=overrides, trusted=trusted)
    with run_config_guard(cfg, run_dir / "config.toml", overrides=overrides, trusted=trusted):
        setup = build(cfg)
    try:
        step = load_policy_weights(run_dir, setup.model)
    except StateError as e:
        raise RunError(str(e)) from None
    note(f"{run_dir} has no final {name}/ or best/ (the run was cut off); loading the last saved state (step {step})")
    return cfg, setup.model, setup.tokenizer
