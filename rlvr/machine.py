"""The machine a run starts on: torch threads and the oversubscription warning (cores other
processes keep busy), and the one timing harness the speed probes share (`device_sync`,
`time_calls`, `ordered_pair`) with the fp32 matmul rate the price's FLOP bound divides by.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from rlvr import config as config_mod


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


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for `device`'s queued work: torch.cuda.synchronize on a GPU, nothing on a CPU."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def time_calls(fn: Callable[[], object], device: torch.device, calls: int = 1) -> float:
    """Seconds per call of `fn()` called `calls` times in a row on `device`, the device synchronised
    before the clock starts and after the last call (a GPU's queued work counted in full). The
    timing harness of every speed probe (`matmul_rate`, rlvr.numerics.autocast_timings,
    rlvr.probes.decode_step_seconds, rlvr.learn.learn_part_seconds)."""
    sync = device_sync(device)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls


def time_until(fn: Callable[[], object], device: torch.device, seconds: float) -> tuple[int, float]:
    """(calls, elapsed seconds) of `fn()` called again and again, the device synchronised after each
    call, until at least `seconds` have passed (at least one call)."""
    sync = device_sync(device)
    count, t0 = 0, time.perf_counter()
    while True:
        fn()
        count += 1
        sync()
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return count, elapsed


def ordered_pair(small: Callable[[], float], large: Callable[[], float], retries: int,
                 rounds: int = 1) -> tuple[float, float]:
    """(small's time, large's time) of two timed calls of which the larger does more work: each timed
    `rounds` times in turn, each call's best kept, then the pair again up to `retries` times while
    the larger measured no longer than the smaller (a busy core or a tiny model's noise), so that
    their difference is the extra work's time wherever it can be measured."""
    one, two = small(), large()
    for _ in range(rounds - 1):
        one, two = min(one, small()), min(two, large())
    for _ in range(retries):
        if two > one:
            break
        one, two = min(one, small()), min(two, large())
    return one, two


def cuda_free_bytes(device: torch.device) -> int:
    """Bytes a new allocation on CUDA `device` can get: the driver's free memory plus what torch's
    caching allocator has reserved and is not using."""
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


_MATMUL_RATES: dict[tuple[str, int], float] = {}


def matmul_rate(device: torch.device, seconds: float = 1.0) -> float:
    """FLOP/s of fp32 matrix products on `device` at torch's current thread count, measured once
    per process (about `seconds` of square products; a few ms when cached). An upper bound on
    what a model reaches: a small model's products are smaller and sampling adds per-token overhead."""
    key = (str(device), torch.get_num_threads())
    if key not in _MATMUL_RATES:
        _MATMUL_RATES[key] = measure_matmul_rate(device, seconds)
    return _MATMUL_RATES[key]


def cached_matmul_rate(device: torch.device) -> float | None:
    """`matmul_rate` as this process measured it at torch's current thread count; None where it has not."""
    return _MATMUL_RATES.get((str(device), torch.get_num_threads()))


def measure_matmul_rate(device: torch.device, seconds: float) -> float:
    """`matmul_rate` measured now, not cached: FLOP/s of about `seconds` of square fp32 products
    (512 on a CPU, 2048 on a GPU) at torch's current thread count."""
    n = 2048 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b  # warm-up
    device_sync(device)()
    count, elapsed = time_until(lambda: a @ b, device, seconds)
    return 2 * n**3 * count / elapsed
