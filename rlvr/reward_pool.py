"""Rewards and goal checks in supervised worker processes: in parallel, each call time- and memory-limited.

Why
---
A reward is user code. In the trainer's own process a reward that hangs hangs the run, one that calls
``os._exit`` or segfaults ends it without a word, and a slow one is paid once per response, one
after the other. A :class:`RewardPool` runs the calls in ``workers`` long-lived child processes instead:

* in parallel: a batch is cut into chunks (about ``CHUNKS_PER_WORKER`` per worker) handed to whichever
  worker is free;
* each call with a timeout: a call that runs past ``timeout_s`` gets status ``timeout``, its worker is
  killed (with anything it started) and replaced, and the rest of its chunk goes on in another worker;
* each worker with an address-space limit (``RLIMIT_AS``): a reward that allocates past ``memory_mb``
  gets a MemoryError (status ``error``) instead of taking the machine's memory;
* each worker with limits on processes (``RLIMIT_NPROC``), file size (``RLIMIT_FSIZE``) and CPU time
  (``RLIMIT_CPU``), every limit's hard value equal to its soft one and the worker without
  ``CAP_SYS_RESOURCE``, so a reward cannot raise them (:class:`Limits`); an environment holding only
  allow-listed names (:func:`worker_env`), so the trainer's tokens and keys do not reach a reward;
* the processes a reward starts die with its worker: the worker is their reaper (Linux
  ``PR_SET_CHILD_SUBREAPER``), so one that left its process group with ``setsid`` stays its
  descendant, and the pool stops and kills the whole tree (:func:`rlvr.process_tree.kill_tree`) when it closes or
  replaces the worker;
* a worker that dies (``os._exit``, a signal, a segfault, the kernel's out-of-memory killer) gives the
  call it was running status ``crashed`` and is replaced; ``SystemExit`` or ``KeyboardInterrupt``
  raised by the reward's code is status ``exit`` and the worker goes on (workers ignore Ctrl-C, which is
  the trainer's to handle).

Scoring never stops: every (reward, response) gets a :class:`~rlvr.rewards.Score`, and the caller counts
the statuses (:func:`rlvr.rewards.score_batch`, :func:`rlvr.rewards.goal_hits`, both take ``pool=``).

How a worker gets the rewards
-----------------------------
Nothing callable crosses the process boundary. A worker is a fresh interpreter (``python -c``, like the
math-verify worker in :mod:`rlvr.tasks.mathverify`: no inherited threads, CUDA state or re-imported
``__main__``) that rebuilds the task with ``load_task(path, **options)``, as the trainer did, and looks the
rewards up by name. Requests (prompts, responses, answers) go to the worker pickled (the worker trusts
its parent); results come back as JSON lines, so the trainer never unpickles anything a reward made.

Usage::

    with open_pool(cfg.task, task) as pool:          # None when task.reward_workers = 0
        scored = score_batch(weighted, prompts, responses, answers, pool=pool)
        hits, failures, errors = goal_hits(task.goal, prompts, responses, answers, pool=pool)

POSIX only (``select`` on pipes, ``RLIMIT_AS``); workers die with the process that started them (Linux
``PR_SET_PDEATHSIG``), so a killed trainer leaves no stray worker behind.

A fault boundary, not a sandbox: a reward still runs as the trainer's user, can read every file that
user can, and can use the network. Hostile reward code belongs in a container (docs/security.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import secrets
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Iterator, Sequence

from rlvr.isolation import python_argv
from rlvr.process_tree import WORKER_MARK, kill_tree
from rlvr.reward_worker import ENV_JOB, TOOL_JOB
from rlvr.rewards import Score, StepScores

__all__ = ["RewardPool", "RewardPoolError", "open_pool", "available_cores", "DEFAULT_TIMEOUT_S",
           "DEFAULT_MEMORY_MB", "Limits", "limits_of", "worker_env", "WORKER_ENV_NAMES"]

DEFAULT_TIMEOUT_S = 60.0
"""Seconds one reward or goal call may take in a worker before it is status ``timeout``."""
DEFAULT_MEMORY_MB = 4096
"""Address space (MB) a worker may add to what loading the task took; 0 = no limit."""
START_TIMEOUT_S = 120.0
"""Seconds a fresh worker may take to start and load the task."""
CHUNKS_PER_WORKER = 4
"""A batch is cut into about this many chunks per worker (balances uneven call times)."""
MAX_TRIES = 3
"""A chunk whose worker dies before running any of it (not the reward's fault) is sent again this often."""
DEFAULT_PROCESSES = 1024
"""Processes and threads a worker's user may start beyond those it runs when the worker starts
(RLIMIT_NPROC); 0 = no limit."""
DEFAULT_FILE_MB = 1024
"""Largest file (MB) a worker, or a process it starts, may write (RLIMIT_FSIZE); 0 = no limit."""
DEFAULT_CPU_S = 3600
"""CPU seconds a worker, and each process it starts, may use in its life (RLIMIT_CPU); 0 = no limit."""
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false"}
"""One thread per worker: the pool is the parallelism (and torch in a worker would otherwise take every core)."""
WORKER_ENV_NAMES = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ", "TERM",
                    "TMPDIR", "TEMP", "TMP", "LD_LIBRARY_PATH", "PYTHONHASHSEED", "PYTHONUTF8", "PYTHONIOENCODING",
                    "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS", "OMP_*", "MKL_*", "OPENBLAS_*", "NUMEXPR_*",
                    "VECLIB_MAXIMUM_THREADS", "TOKENIZERS_PARALLELISM", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE",
                    "HF_DATASETS_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
                    "RLVR_CACHE")
"""The trainer's environment variables a worker receives (a trailing ``*`` matches a prefix): what a
reward or a task factory needs to run (the search path, home, locale, temporary directory, thread
counts, cache locations). Nothing else crosses, so tokens and keys (``HF_TOKEN``, cloud credentials)
stay in the trainer; ``task.reward_env`` names more."""


@dataclass(frozen=True)
class Limits:
    """The resource limits of a worker and of every process it starts, each with hard = soft.

    Set after the task is loaded, so they bound the reward calls; 0 = no limit, for each.

    * ``memory_mb``: address space beyond what loading the task took (RLIMIT_AS);
    * ``processes``: processes and threads the worker's user may add to those it runs when the worker
      starts (RLIMIT_NPROC: the kernel counts it per user, over all of that user's processes, and does
      not enforce it for root);
    * ``file_mb``: the largest file a write may make (RLIMIT_FSIZE: per file, not the total written;
      a write past it fails with an OSError);
    * ``cpu_s``: CPU seconds beyond what loading the task took (RLIMIT_CPU, over a process's life: past
      it the kernel kills the process). The pool replaces a worker that has used half between calls,
      so only a runaway call or a process a reward left running meets it.
    """

    memory_mb: int = DEFAULT_MEMORY_MB
    processes: int = DEFAULT_PROCESSES
    file_mb: int = DEFAULT_FILE_MB
    cpu_s: int = DEFAULT_CPU_S


def env_allowed(name: str, patterns: Sequence[str]) -> bool:
    """Whether ``name`` is one of ``patterns`` (an exact name, or a prefix ending in ``*``)."""
    return any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in patterns)


def worker_env(environ: dict[str, str], extra: Sequence[str] = ()) -> dict[str, str]:
    """A worker's environment: the names of ``environ`` allowed by :data:`WORKER_ENV_NAMES` or ``extra``,
    one thread per worker, and ``PYTHONPATH`` set to this interpreter's search path (so the worker
    imports the modules this process does)."""
    patterns = (*WORKER_ENV_NAMES, *extra)
    env = {k: v for k, v in environ.items() if env_allowed(k, patterns)}
    env.update(_WORKER_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    return env



class RewardPoolError(RuntimeError):
    """The pool cannot run at all: a worker cannot start or load the task, or the data cannot be sent."""


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), the default number of workers."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)




@dataclass
class _Chunk:
    jobs: list[tuple[str | None, list[int]]]
    """(reward name, or None for the goal; item indices), in the order the worker runs them."""
    tries: int = 0


class _Worker:
    """One child process and what it is doing: starting, idle, or busy with a chunk."""

    def __init__(self, init: bytes, env_names: Sequence[str] = ()):
        self.mark = secrets.token_hex(12)
        env = dict(worker_env(dict(os.environ), env_names), RLVR_POOL_PARENT=str(os.getpid()))
        env[WORKER_MARK] = self.mark
        self.proc = subprocess.Popen(
            python_argv("from rlvr.reward_worker import serve; serve()"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0, start_new_session=True,
        )
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.state = "starting"
        self.deadline = time.monotonic() + START_TIMEOUT_S
        self.chunk: _Chunk | None = None
        self.j = self.k = 0          # the next call it will report: jobs[j], item k of it
        self.batch = False           # a batched call of jobs[j] is running
        self.names: list[str] = []
        self.cpu0 = 0.0              # CPU seconds it had used when the task was loaded
        self.write(init)

    def write(self, body: bytes) -> None:
        self.proc.stdin.write(struct.pack(">Q", len(body)) + body)

    def kill(self) -> None:
        """Kill the worker and every process its rewards started (:func:`kill_tree`)."""
        kill_tree(self.proc.pid if self.proc.poll() is None else None, self.mark)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()

    def how_it_died(self) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        code = self.proc.returncode
        if code is not None and code < 0:
            try:
                return f"signal {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit code {code}"


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.kill()
    workers.clear()


class RewardPool:
    """``workers`` processes that each hold the task ``load_task(task_path, **task_options)``.

    ``workers`` None = :func:`available_cores`. Starts them all and waits until each has loaded the task
    (RewardPoolError if one cannot). ``restarts`` counts workers replaced after a timeout or a crash,
    ``recycled`` those replaced, idle, after using half their CPU limit. ``limits`` are each worker's
    (:class:`Limits`; ``memory_mb`` given alone sets that one), ``env`` names environment variables
    the workers receive beyond :data:`WORKER_ENV_NAMES`.
    Use as a context manager, or call :meth:`close`. One call at a time (a lock serializes them).
    """

    def __init__(self, task_path: str, task_options: dict | None = None, *, workers: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, memory_mb: int | None = None, limits: Limits | None = None,
                 env: Sequence[str] = ()):
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1 (or None for one per core), got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.task_path, self.task_options = task_path, dict(task_options or {})
        limits = limits or Limits()
        if memory_mb is not None:
            limits = replace(limits, memory_mb=int(memory_mb))
        self.timeout_s, self.limits, self.env_names = float(timeout_s), limits, tuple(env)
        self.memory_mb = limits.memory_mb
        self.n_workers = workers or available_cores()
        self.restarts = self.recycled = 0
        self.reward_names: list[str] = []
        self._init = pickle.dumps({"path": task_path, "options": self.task_options, "limits": limits})
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        try:
            for _ in range(self.n_workers):
                self._workers.append(_Worker(self._init, self.env_names))
            self._loop(deque(), {})  # wait until every worker is ready
        except BaseException:
            self.close()
            raise
        self.reward_names = self._workers[0].names

    # -- lifetime
    def close(self) -> None:
        """Stop every worker (idempotent)."""
        self._finalizer()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def check_answers(self, answers: Sequence[Any]) -> None:
        """RewardPoolError unless these answers can be sent to a worker (pickled)."""
        try:
            pickle.dumps(list(answers))
        except Exception as e:
            raise RewardPoolError(f"the task's answers cannot be sent to reward workers ({type(e).__name__}: {e}); "
                                  "set task.reward_workers = 0 to score in the trainer's process") from None

    # -- scoring
    def scores(self, names: Sequence[str], prompts: Sequence[str], responses: Sequence[str],
               answers: Sequence[Any]) -> dict[str, list[Score]]:
        """{name: one Score per response} for the task's rewards ``names``."""
        return self.run(names, prompts, responses, answers, goal=False)[0]

    def tool_calls(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Any]) -> list[Score]:
        """The task's tool on every response (rlvr.rewards.call_tool): value the text to insert or None
        when status is ``ok``; a call past the timeout, or whose worker died, has status ``timeout`` /
        ``crashed``, as a reward call would."""
        return self.run([TOOL_JOB], prompts, responses, answers, goal=False)[0][TOOL_JOB]

    def env_steps(self, prompts: Sequence[str], episodes: Sequence[Any], answers: Sequence[Any]) -> list[Score]:
        """The task's environment stepped through each episode so far (rlvr.environments.step_episode):
        value ``[observation, reward, done]`` when status is ``ok``; ``timeout`` / ``crashed`` as for a tool."""
        return self.run([ENV_JOB], prompts, episodes, answers, goal=False)[0][ENV_JOB]

    def goals(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Any]) -> list[Score]:
        """The task's goal per response as a Score (value 1.0 met, 0.0 not; see rlvr.rewards.check_goal)."""
        return self.run([], prompts, responses, answers, goal=True)[1]

    def run(self, names: Sequence[str], prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Any],
            *, goal: bool) -> tuple[dict[str, list[Score]], list[Score]]:
        """Rewards ``names`` (and the goal when ``goal``) on every response, in one pass over the workers."""
        n = len(responses)
        if len(prompts) != n or len(answers) != n:
            raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses and {len(answers)} answers; "
                             "they must be aligned, one row per response")
        unknown = [x for x in names if x not in self.reward_names and x not in (TOOL_JOB, ENV_JOB)]
        if unknown:
            raise ValueError(f"reward {unknown[0]!r} is not one of the pool's task {self.task_path!r} rewards "
                             f"({', '.join(self.reward_names)})")
        what: list[str | None] = list(names) + ([None] if goal else [])
        with self._lock:
            if not self._workers:
                raise RewardPoolError("the reward pool is closed")
            self._payload = (prompts, responses, answers)
            results: dict[tuple[str | None, int], Score] = {}
            try:
                if n and what:
                    n_chunks = min(n, self.n_workers * CHUNKS_PER_WORKER)
                    bounds = [round(c * n / n_chunks) for c in range(n_chunks + 1)]
                    chunks = deque(_Chunk([(x, list(range(a, b))) for x in what])
                                   for a, b in zip(bounds, bounds[1:]) if b > a)
                    self._loop(chunks, results)
            except BaseException:
                # interrupted (Ctrl-C) or failed: a worker still busy with this call would answer the next
                # one with stale results, so it is replaced
                for w in list(self._workers):
                    if w.state == "busy":
                        self._replace(w)
                raise
            finally:
                self._payload = None
        per_reward = {x: [results[(x, i)] for i in range(n)] for x in names}
        goals = [results[(None, i)] for i in range(n)] if goal else []
        return per_reward, goals

    # -- the event loop
    def _loop(self, pending: deque, results: dict) -> None:
        """Hand out chunks and collect results until nothing is pending, busy or starting."""
        while True:
            for w in self._workers:
                if w.state == "idle" and pending:
                    self._send(w, pending.popleft(), pending, results)
            active = [w for w in self._workers if w.state in ("starting", "busy")]
            if not active:
                if pending:  # pragma: no cover - every worker is replaced, so one is always starting or idle
                    continue
                return
            wait = max(0.0, min(w.deadline for w in active) - time.monotonic())
            ready = set(select.select([w.fd for w in active], [], [], wait)[0])
            now = time.monotonic()
            for w in active:
                if w.fd in ready:
                    self._read(w, pending, results)
                elif now >= w.deadline:
                    self._expire(w, pending, results)

    def _send(self, w: _Worker, chunk: _Chunk, pending: deque, results: dict) -> None:
        prompts, responses, answers = self._payload
        idx = sorted({i for _, ix in chunk.jobs for i in ix})
        try:
            body = pickle.dumps(({i: (prompts[i], responses[i], answers[i]) for i in idx}, chunk.jobs))
        except Exception as e:
            raise RewardPoolError(f"cannot send the responses and answers to a reward worker ({type(e).__name__}: "
                                  f"{e}); set task.reward_workers = 0 to score in the trainer's process") from None
        w.state, w.chunk, w.j, w.k, w.batch = "busy", chunk, 0, 0, False
        w.deadline = time.monotonic() + self.timeout_s
        try:
            w.write(body)
        except OSError:  # it died while idle: not the reward's fault, send the chunk again
            self._replace(w)
            chunk.tries += 1
            if chunk.tries >= MAX_TRIES:
                self._fail(chunk.jobs, "crashed", "reward workers keep dying before running anything", results)
            else:
                pending.appendleft(chunk)

    def _read(self, w: _Worker, pending: deque, results: dict) -> None:
        data = os.read(w.fd, 1 << 16)
        if not data:
            return self._lost(w, "crashed", f"the reward worker died ({w.how_it_died()})", pending, results)
        w.buf += data
        *lines, w.buf = w.buf.split(b"\n")
        for msg in json.loads(b"[" + b",".join(lines) + b"]") if lines else ():  # one parse for the read's lines
            if "s" in msg:
                name, idx = w.chunk.jobs[w.j]
                got = Score(*msg["s"])
                results[(name, msg["i"])] = got._replace(value=StepScores(msg["steps"])) if msg.get("steps") else got
                w.batch = False
                w.k += 1
                if w.k == len(idx):
                    w.j, w.k = w.j + 1, 0
                w.deadline = time.monotonic() + self.timeout_s
            elif "batch" in msg:
                w.batch = True
                w.deadline = time.monotonic() + self.timeout_s * len(w.chunk.jobs[w.j][1])
            elif "done" in msg:
                w.state, w.chunk = "idle", None
                if self.limits.cpu_s > 0 and 2 * (msg.get("cpu", 0.0) - w.cpu0) > self.limits.cpu_s:
                    self._replace(w, restart=False)  # long before RLIMIT_CPU would kill it mid-call
            elif "ready" in msg:
                w.state, w.names, w.cpu0 = "idle", msg["ready"], msg.get("cpu", 0.0)
            elif "fail" in msg:
                raise RewardPoolError(f"a reward worker cannot load the task {self.task_path!r}: {msg['fail']}")
            elif "bad" in msg:
                self._fail(w.chunk.jobs, "error", f"a reward worker cannot read the answers: {msg['bad']}", results)
                w.state, w.chunk = "idle", None

    def _expire(self, w: _Worker, pending: deque, results: dict) -> None:
        if w.state == "starting":
            w.kill()
            raise RewardPoolError(f"a reward worker did not load the task {self.task_path!r} within "
                                  f"{START_TIMEOUT_S:g} s")
        self._lost(w, "timeout", f"took longer than {self.timeout_s:g} s (task.reward_timeout_s); its worker was "
                   "killed and replaced",
                   pending, results)

    def _lost(self, w: _Worker, status: str, detail: str, pending: deque, results: dict) -> None:
        """The worker died or hung: the call in flight gets `status`, the rest of its chunk goes back."""
        if w.state == "starting":
            raise RewardPoolError(f"a reward worker exited while loading the task {self.task_path!r} "
                                  f"({w.how_it_died()}); its error is printed above")
        chunk, j, k, batch = w.chunk, w.j, w.k, w.batch
        self._replace(w)
        if chunk is None:  # died between chunks
            return
        name, idx = chunk.jobs[j]
        failed = idx[k:] if batch else idx[k:k + 1]
        self._fail([(name, failed)], status, detail, results)
        rest = [(name, idx[k + len(failed):])] + chunk.jobs[j + 1:]
        rest = [(x, ix) for x, ix in rest if ix]
        if rest:
            pending.appendleft(_Chunk(rest))

    def _fail(self, jobs: list, status: str, detail: str, results: dict) -> None:
        for name, idx in jobs:
            for i in idx:
                results[(name, i)] = Score(0.0, status, detail)

    def _replace(self, w: _Worker, restart: bool = True) -> None:
        w.kill()
        if restart:
            self.restarts += 1
        else:
            self.recycled += 1
        self._workers[self._workers.index(w)] = _Worker(self._init, self.env_names)


def limits_of(task_cfg: Any) -> Limits:
    """The worker limits of a run's ``[task]`` section (a limit it does not name keeps its default)."""
    return Limits(memory_mb=task_cfg.reward_memory_mb,
                  processes=getattr(task_cfg, "reward_processes", DEFAULT_PROCESSES),
                  file_mb=getattr(task_cfg, "reward_file_mb", DEFAULT_FILE_MB),
                  cpu_s=getattr(task_cfg, "reward_cpu_s", DEFAULT_CPU_S))


@contextlib.contextmanager
def open_pool(task_cfg: Any, task: Any = None) -> Iterator[RewardPool | None]:
    """The pool a run's ``[task]`` section asks for (``reward_workers``, ``reward_timeout_s``,
    ``reward_memory_mb``, ``reward_processes``, ``reward_file_mb``, ``reward_cpu_s``, ``reward_env``,
    ``path``, ``options``), closed on exit; None when ``reward_workers == 0``
    (score in this process). With the loaded ``task``, also checks up front that its answers can be
    sent to the workers."""
    if task_cfg.reward_workers == 0:
        yield None
        return
    pool = RewardPool(task_cfg.path, task_cfg.options,
                      workers=task_cfg.reward_workers if task_cfg.reward_workers > 0 else None,
                      timeout_s=task_cfg.reward_timeout_s, limits=limits_of(task_cfg),
                      env=getattr(task_cfg, "reward_env", ()))
    try:
        if task is not None:
            pool.check_answers([ex.answer for ex in list(task.train[:1]) + list(task.heldout[:1])])
        yield pool
    finally:
        pool.close()
