"""Finding and killing a reward worker's whole process tree: its descendants (read from /proc) and
every process carrying its mark in the environment, stopped round after round, then killed together."""

from __future__ import annotations

import contextlib
import os
import signal

MAX_TREE_ROUNDS = 20
"""Rounds of stopping a worker's descendants before they are killed (a round that finds none new ends it)."""
WORKER_MARK = "RLVR_REWARD_WORKER"
"""Environment variable holding a worker's own random mark: every process it starts inherits it, so
one that outlived a worker that died on its own is still found by it (:func:`kill_tree`)."""


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every process in /proc (empty where there is none)."""
    table = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:  # pragma: no cover - not Linux
        return table
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                table[pid] = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return table


def descendants(pid: int, parents: dict[int, int]) -> set[int]:
    """The processes below ``pid`` in the tree ``parents`` ({pid: parent pid}), ``pid`` not included."""
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    found, todo = set(), list(children.get(pid, []))
    while todo:
        p = todo.pop()
        if p not in found:
            found.add(p)
            todo += children.get(p, [])
    return found


def marked(mark: str) -> set[int]:
    """The processes (other than this one) whose environment holds ``WORKER_MARK=mark``: those a worker
    started, and theirs, unless one replaced its environment."""
    needle, found = f"{WORKER_MARK}={mark}".encode(), set()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:  # pragma: no cover - not Linux
        return found
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.add(pid)
        except OSError:
            continue
    return found


def _signal_all(pids: set[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, sig)


def kill_tree(pid: int | None, mark: str) -> None:
    """SIGKILL the live worker ``pid`` (a child of this process not yet waited for, or None when it is
    gone), its process group, its descendants and every process carrying its ``mark``.

    The worker and its descendants are first stopped (SIGSTOP), round after round until a round finds
    none new (a stopped process cannot start another, so none escapes between the listing and the
    kill), then killed together. A worker is the reaper of its orphans (`rlvr.reward_worker`), so a process
    that called ``setsid`` and lost its parent is still below it; one that outlived a worker that died
    on its own is found by the mark in its environment."""
    doomed: set[int] = set()
    if pid is not None:
        doomed.add(pid)
        for _ in range(MAX_TREE_ROUNDS):
            _signal_all(doomed, signal.SIGSTOP)
            more = (descendants(pid, _parents()) | marked(mark)) - doomed
            if not more:
                break
            doomed |= more
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)  # the worker is not waited for yet, so its group id is its own
    for _ in range(MAX_TREE_ROUNDS):
        doomed |= marked(mark)
        _signal_all(doomed, signal.SIGKILL)
        doomed = marked(mark) - doomed
        if not doomed:
            return
