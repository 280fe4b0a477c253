"""What `rlvr train --overwrite` may replace, and what it deletes there.

A directory is replaced only when rlvr recognises it as a run it wrote (`looks_like_run`: a regular
config.toml beside a regular price.json or metrics.jsonl, both written at the start of every run),
and then only the names rlvr writes are deleted (`is_run_name`, `clear_run`); anything else in it is
kept. Never replaced, whatever it holds: a symbolic link, the current directory or one above it, the
home directory or one above it, and `/` (`overwrite_refusal`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path

from rlvr.state import STATE_DIR

RUN_FILES = frozenset({"config.toml", "price.json", "metrics.jsonl", "rollouts.jsonl", "summary.json",
                       "summary.json.tmp"})
"""The files `rlvr train` writes at the top of a run directory."""
RUN_DIRS = frozenset({STATE_DIR, "best", "snapshots", "checkpoint", "hf", "report", "tensorboard", "mlruns", "wandb"})
"""The directories rlvr writes into a run directory: the run's (rlvr.rundir), its trackers' (rlvr.tracking)
and `rlvr report`'s."""
ATOMIC_DIRS = (STATE_DIR, "best", "checkpoint", "hf")
"""Directories written beside and renamed into place (rlvr.state): `NAME.<step>.tmp` and `NAME.old` are rlvr's too."""


def is_run_name(name: str) -> bool:
    """True for a name rlvr writes at the top of a run directory (the only names --overwrite deletes)."""
    if name in RUN_FILES or name in RUN_DIRS or name.startswith(".rlvr-write-check-"):
        return True
    stem, dot, rest = name.partition(".")
    return stem in ATOMIC_DIRS and bool(dot) and (rest == "old" or (rest.endswith(".tmp") and rest[:-4].isdigit()))


def _own_file(path: Path) -> bool:
    """True when `path` is a regular file itself (not a symbolic link)."""
    with contextlib.suppress(OSError):
        return stat.S_ISREG(os.lstat(path).st_mode)
    return False


def looks_like_run(d: Path) -> bool:
    """True when `d` is a directory rlvr wrote as a run: a regular config.toml beside a regular price.json
    or metrics.jsonl, none of them a symbolic link."""
    d = Path(d)
    return _own_file(d / "config.toml") and (_own_file(d / "price.json") or _own_file(d / "metrics.jsonl"))


def overwrite_refusal(out: Path) -> str | None:
    """Why `--out out --overwrite` may not replace `out`, or None. Refused: a symbolic link; the current
    directory or one above it; the home directory or one above it; `/`; a file; a directory that holds
    files but is not a run directory (`looks_like_run`). An empty or missing directory is fine."""
    out = Path(out)
    if out.is_symlink():
        return f"--out {out} is a symbolic link (to {os.readlink(out)}); give the directory itself"
    real = Path(os.path.realpath(out))
    cwd = Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        where = "the current directory" + ("" if real == cwd else " or one above it")
        return f"--out {out} is {where}; --overwrite never replaces it: choose a run directory of its own"
    with contextlib.suppress(RuntimeError, KeyError, OSError):
        home = Path.home().resolve()
        if real == home or real in home.parents:
            where = "the home directory" + ("" if real == home else " or one above it")
            return f"--out {out} is {where}; --overwrite never replaces it: choose a run directory of its own"
    if real == real.parent:
        return f"--out {out} is the root directory; --overwrite never replaces it"
    if not out.exists():
        return None
    if not out.is_dir():
        return f"--out {out} is a file, not a directory; choose another path"
    if any(out.iterdir()) and not looks_like_run(out):
        return (f"--out {out} holds files but is not a run directory (no config.toml beside price.json or "
                f"metrics.jsonl); --overwrite replaces only a run rlvr wrote, so nothing was deleted: choose "
                f"another directory")
    return None


def clear_run(out: Path) -> list[str]:
    """Delete the names rlvr writes in the run directory `out` (`is_run_name`; a symbolic link is unlinked,
    never followed) and return the names kept (what rlvr did not write), sorted."""
    kept = []
    for entry in sorted(os.scandir(out), key=lambda e: e.name):
        if not is_run_name(entry.name):
            kept.append(entry.name)
        elif entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    return kept
