"""The reward worker: the loop a :class:`~rlvr.reward_pool.RewardPool` worker runs in its own fresh
interpreter (``python -c "from rlvr.reward_worker import serve; serve()"``).

It loads the task, contains itself (the reaper of what its rewards start, no new privileges, no
``CAP_SYS_RESOURCE``), sets its resource limits, then answers chunks of reward and goal calls until
its stdin closes. The protocol is in :func:`serve`'s docstring.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import struct
import sys
from typing import TYPE_CHECKING, Any

from rlvr.environments import step_episode
from rlvr.rewards import Reward, Score, call_tool, check_goal, check_value, score, steps_of

if TYPE_CHECKING:
    from rlvr.reward_pool import Limits

CAP_SYS_RESOURCE = 24
"""The Linux capability that lets a process raise its hard resource limits (root holds it)."""
TOOL_JOB = "\x00tool"
"""The job name under which a worker calls the task's tool (rlvr.tools) instead of a reward: its
Score's value is the text to insert (or None)."""
ENV_JOB = "\x00env"
"""The job name under which a worker steps the task's environment (rlvr.environments.step_episode): its
Score's value is ``[observation, reward, done]``."""


def _read_frame(stream) -> Any:
    """One length-prefixed pickle from the parent; None at end of input."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack(">Q", head)
    body = stream.read(n)
    if len(body) < n:
        return None
    return body


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except Exception:  # pragma: no cover - no prctl: the closed stdin still ends the worker
            pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def _contain() -> None:
    """Linux: make this worker the reaper of its orphaned descendants (``PR_SET_CHILD_SUBREAPER``: a
    process a reward started stays in the worker's tree even after ``setsid`` and its parent's exit,
    so :func:`rlvr.process_tree.kill_tree` finds it), forbid gaining privileges through exec (``PR_SET_NO_NEW_PRIVS``:
    no setuid programs), and drop ``CAP_SYS_RESOURCE`` (from the bounding, effective, permitted and
    inheritable sets), so a worker run as root cannot raise its hard limits. Elsewhere, nothing."""
    if not sys.platform.startswith("linux"):  # pragma: no cover
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)                    # PR_SET_CHILD_SUBREAPER
    libc.prctl(38, 1, 0, 0, 0)                    # PR_SET_NO_NEW_PRIVS
    libc.prctl(24, CAP_SYS_RESOURCE, 0, 0, 0)     # PR_CAPBSET_DROP (fails without CAP_SETPCAP: no caps to drop)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    head, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3: 2 x 32 bits
    if libc.capget(ctypes.byref(head), data) != 0:  # pragma: no cover
        return
    bit = ~(1 << CAP_SYS_RESOURCE) & 0xFFFFFFFF
    if (data[0].effective | data[0].permitted | data[0].inheritable) & (1 << CAP_SYS_RESOURCE):
        data[0].effective &= bit
        data[0].permitted &= bit
        data[0].inheritable &= bit
        if libc.capset(ctypes.byref(head), data) != 0:  # pragma: no cover
            raise OSError(ctypes.get_errno(), "cannot drop CAP_SYS_RESOURCE")


def _user_tasks(uid: int) -> int | None:
    """Processes and threads of user ``uid`` now (what RLIMIT_NPROC counts); None without /proc."""
    n = 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:  # pragma: no cover - not Linux
        return None
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields["Threads"])
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return n


def _set_limit(which: int, value: int) -> None:
    """setrlimit(which, (value, value)), at most the current hard limit (a process may only lower it)."""
    import resource

    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def _limit_memory(memory_mb: int) -> None:
    """RLIMIT_AS (hard and soft) = the address space in use now (the loaded task) + memory_mb."""
    if memory_mb <= 0:
        return
    import resource

    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):  # pragma: no cover - not Linux
        used = 0
    _set_limit(resource.RLIMIT_AS, used + memory_mb * 2**20)


def _apply_limits(limits: Limits) -> None:
    """Every limit of ``limits`` on this process (and so on every process it starts), hard = soft; a
    write past the file limit raises an OSError instead of ending the process (SIGXFSZ ignored)."""
    import resource

    _limit_memory(limits.memory_mb)
    running = _user_tasks(os.getuid())
    if limits.processes > 0 and running is not None:  # without the count, a limit could stop every fork
        _set_limit(resource.RLIMIT_NPROC, running + limits.processes)
    if limits.file_mb > 0:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        _set_limit(resource.RLIMIT_FSIZE, limits.file_mb * 2**20)
    if limits.cpu_s > 0:
        _set_limit(resource.RLIMIT_CPU, int(_cpu_seconds()) + 1 + limits.cpu_s)


def _cpu_seconds() -> float:
    """CPU seconds this process has used (what RLIMIT_CPU counts)."""
    t = os.times()
    return t.user + t.system


def _batch_scores(reward: Reward, prompts: list, responses: list, answers: list) -> list[Score] | None:
    """The reward's batch_fn on a whole job, or None (no batch_fn, it failed, or the count is wrong)."""
    if reward.batch_fn is None:
        return None
    try:
        out = list(reward.batch_fn(prompts, responses, answers))
    except BaseException:  # noqa: BLE001 - in a worker every failure falls back to one call per item
        return None
    return [check_value(v) for v in out] if len(out) == len(responses) else None


def serve() -> None:
    """The worker loop: load the task, then answer chunks until stdin closes.

    Protocol: the parent writes length-prefixed pickles (first ``{"path", "options", "limits"}``, then
    ``(items, jobs)`` with ``items = {i: (prompt, response, answer)}`` and ``jobs = [(reward name or None
    for the goal, [i, ...]), ...]``). The worker writes JSON lines on a private copy of stdout (fd 1 is
    pointed at stderr so a reward's prints cannot corrupt it): ``{"ready": [names]}`` or ``{"fail": msg}``
    once; per chunk, ``{"batch": j}`` before a batched call of job j, ``{"j": j, "i": i, "s": [...Score]}``
    per call in job order, then ``{"done": 1, "cpu": seconds used}`` (or ``{"bad": msg}`` if the chunk cannot be read).
    """
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's; a KeyboardInterrupt here is the reward's
    _die_with_parent(int(os.environ.get("RLVR_POOL_PARENT", os.getppid())))
    inp = sys.stdin.buffer

    def send(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    body = _read_frame(inp)
    if body is None:
        return
    init = pickle.loads(body)
    try:
        _contain()
    except OSError as e:  # pragma: no cover
        send({"fail": f"cannot contain the worker: {e}"})
        return
    try:
        from rlvr.tasks import load_task

        task = load_task(init["path"], **init["options"])
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        send({"fail": f"{type(e).__name__}: {e}"})
        return
    try:
        _apply_limits(init["limits"])
    except (OSError, ValueError) as e:  # pragma: no cover
        send({"fail": f"cannot set the worker's resource limits: {e}"})
        return
    send({"ready": list(task.rewards), "cpu": _cpu_seconds()})
    while True:
        body = _read_frame(inp)
        if body is None:
            return
        try:
            items, jobs = pickle.loads(body)
        except BaseException as e:  # noqa: BLE001
            send({"bad": f"{type(e).__name__}: {e}"})
            continue
        for j, (name, idx) in enumerate(jobs):
            p, r, a = ([items[i][k] for i in idx] for k in range(3))
            if name is None:
                scores: Any = (check_goal(task.goal, *items[i], interrupts=True) for i in idx)
            elif name == TOOL_JOB:
                scores = (call_tool(task.tool, *items[i], interrupts=True) for i in idx)
            elif name == ENV_JOB:
                scores = (step_episode(task.environment, *items[i], interrupts=True) for i in idx)
            else:
                reward = task.rewards[name]
                batched = None
                if reward.batch_fn is not None:
                    send({"batch": j})
                    batched = _batch_scores(reward, p, r, a)
                scores = batched if batched is not None else (
                    score(reward.fn, *items[i], interrupts=True) for i in idx)
            for i, s in zip(idx, scores):
                if s.status == "error" and s.detail.startswith("MemoryError") and init["limits"].memory_mb > 0:
                    s = s._replace(detail=f"MemoryError: over the worker's memory limit ({init['limits'].memory_mb} MB "
                                          "beyond the loaded task, task.reward_memory_mb)")
                steps = steps_of(s.value)  # a process reward's per-step scores travel beside their mean
                send({"j": j, "i": i, "s": list(s), **({"steps": list(steps)} if steps else {})})
        send({"done": 1, "cpu": _cpu_seconds()})
