"""Resumable training state, without pickle, saved so that a kill at any instant loses nothing.

`run_dir/state/` holds `tensors.safetensors` (policy, reference when held, AdamW moments, the
sampling generator's state) and `state.json` (step, optimizer hyper-parameters, scheduler
counters, the prompt-order RNG, the cost counters, training seconds so far, and which tensor names
are aliases of another, such as an lm_head tied to the embeddings).

Crash-safe directories
----------------------
:func:`atomic_dir` writes any run directory this way (`state/`, `checkpoint/`, `best/`):

1. a fresh `NAME.<tag>.tmp/` beside the current copy is filled by the caller;
2. every file in it is fsynced, then a `.complete` marker listing each file's size is written and
   fsynced, and so is the directory: from here on the copy is complete, even if the power fails;
3. the current `NAME/` is renamed to `NAME.old/`, the new copy to `NAME/` (each rename atomic, the
   parent directory fsynced after each), and only then `NAME.old/` is removed.

A kill anywhere leaves at least one complete copy: before step 2 the old `NAME/`; between the
renames a complete `NAME.<tag>.tmp/` (and `NAME.old/`). :func:`find_complete` returns the newest
complete copy (a tmp without its marker was cut off mid-write and is ignored); :func:`recover`
makes it `NAME/` again and removes the leftovers (every save starts with it). :func:`load_state`
reads the newest complete state, wherever it is.

A corrupt copy (a file truncated or missing, bad JSON, a tensor missing or of the wrong shape) is
a :class:`StateError` that names the file.

For tests, the environment variable ``RLVR_TEST_DIE_AT=NAME:PHASE[:N]`` SIGKILLs the process the
N-th time (default 1) a save of directory NAME (``*`` = any) reaches PHASE, one of :data:`PHASES`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import load_file, save_file

__all__ = ["STATE_DIR", "StateError", "PHASES", "save_state", "load_state", "load_policy_weights", "find_state",
           "atomic_dir", "write_dir_atomically", "find_complete", "recover", "verify"]

STATE_DIR = "state"
TENSORS = "tensors.safetensors"
META = "state.json"
MARKER = ".complete"
"""The file whose presence (with every listed file at its listed size) makes a copy complete."""
PHASES = ("begin", "written", "synced", "old_moved", "renamed", "done")
"""Points of a save, in order: tmp made; caller's files written; files, marker and tmp fsynced; current copy
moved to NAME.old; new copy renamed to NAME; NAME.old removed."""
DIE_ENV = "RLVR_TEST_DIE_AT"
_reached: Counter = Counter()


class StateError(RuntimeError):
    """A saved state or checkpoint that cannot be read or written, with the file at fault."""


# ---------------------------------------------------------------------------------------------
# crash-safe directories


def _die_if_asked(name: str, phase: str) -> None:
    """Test hook: SIGKILL this process at `phase` of a save of `name` (see the module doc)."""
    spec = os.environ.get(DIE_ENV)
    if not spec:
        return
    parts = spec.split(":")
    want_name, want_phase, nth = ("*", parts[0], "1") if len(parts) == 1 else (*parts[:2], parts[2] if len(parts) > 2 else "1")
    if want_phase != phase or want_name not in ("*", name):
        return
    _reached[(name, phase)] += 1
    if _reached[(name, phase)] >= int(nth):
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _seal(tmp: Path, tag: int) -> None:
    """fsync every file and directory under `tmp`, then write the marker (fsynced) and fsync `tmp`."""
    files: dict[str, int] = {}
    for root, dirs, names in os.walk(tmp, topdown=False):
        for n in names:
            p = Path(root) / n
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            files[str(p.relative_to(tmp))] = p.stat().st_size
        if Path(root) != tmp:
            _fsync_dir(Path(root))
    with open(tmp / MARKER, "w") as f:
        json.dump({"tag": tag, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)


def _marker(d: Path) -> dict:
    """The marker of copy `d`, checked against the files; StateError naming what is wrong."""
    m = d / MARKER
    try:
        marker = json.loads(m.read_text())
        tag, files = int(marker["tag"]), dict(marker["files"])
    except FileNotFoundError:
        raise StateError(f"{d}: incomplete ({MARKER} is missing: the save was cut off)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StateError(f"{m}: unreadable ({type(e).__name__}: {e})") from None
    for rel, size in files.items():
        p = d / rel
        if not p.is_file():
            raise StateError(f"{p}: missing (the copy in {d} is damaged)")
        if p.stat().st_size != size:
            raise StateError(f"{p}: {p.stat().st_size} bytes, the save wrote {size} (truncated or changed since)")
    return {"tag": tag, "files": files}


def verify(d: str | Path) -> None:
    """StateError naming the file when copy `d` was written with a marker and a file it lists is now
    missing or of another size (truncated); nothing to check in a copy without a marker."""
    if (Path(d) / MARKER).exists():
        _marker(Path(d))


def _leftovers(run_dir: Path, name: str) -> list[Path]:
    pattern = re.compile(rf"^{re.escape(name)}\.(\d+\.tmp|old)$")
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if pattern.match(p.name) and p.is_dir())


def find_complete(run_dir: str | Path, name: str) -> Path | None:
    """The newest complete copy of `run_dir/name`: `name/` itself, or a leftover of an interrupted save
    (`name.<tag>.tmp/` or `name.old/` with a valid marker). None when there is none. Reads only.

    `name/` counts even without a marker (written by an older version) unless a complete leftover is
    newer; a damaged `name/` is returned when nothing else is complete, so that loading it names the
    damage."""
    run_dir = Path(run_dir)
    final = run_dir / name
    best, best_tag = None, None
    if final.is_dir():
        try:
            best_tag = _marker(final)["tag"]
        except StateError:
            best_tag = -1
        best = final
    for d in _leftovers(run_dir, name):
        try:
            tag = _marker(d)["tag"]
        except StateError:
            continue
        if best_tag is None or tag > best_tag:
            best, best_tag = d, tag
    return best


def _install(run_dir: Path, name: str, src: Path) -> None:
    """Make `src` the current `run_dir/name`: old copy aside, new one in, old one removed."""
    final, old = run_dir / name, run_dir / f"{name}.old"
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
        _fsync_dir(run_dir)
        _die_if_asked(name, "old_moved")
    os.rename(src, final)
    _fsync_dir(run_dir)
    _die_if_asked(name, "renamed")
    shutil.rmtree(old, ignore_errors=True)
    _die_if_asked(name, "done")


def recover(run_dir: str | Path, name: str) -> Path | None:
    """Make the newest complete copy `run_dir/name` again and remove every other leftover of an
    interrupted save; returns `run_dir/name`, or None when no complete copy exists."""
    run_dir = Path(run_dir)
    best = find_complete(run_dir, name)
    final = run_dir / name
    if best is not None and best != final:
        if best.name == f"{name}.old" and not final.exists():
            os.rename(best, final)
            _fsync_dir(run_dir)
        else:
            _install(run_dir, name, best)
    for d in _leftovers(run_dir, name):
        shutil.rmtree(d, ignore_errors=True)
    return final if final.is_dir() else None


@contextlib.contextmanager
def atomic_dir(run_dir: str | Path, name: str, tag: int) -> Iterator[Path]:
    """Write `run_dir/name` so that a kill at any instant leaves a complete copy (see the module doc).

    Yields an empty directory to fill; when the block ends without an exception it is sealed and made
    `run_dir/name`; on an exception it is removed and the current copy is kept. `tag` orders the copies
    (the step); an OSError (read-only directory, full disk) is a StateError naming the path::

        with atomic_dir(run_dir, "best", tag=step) as d:
            model.save_pretrained(d)
    """
    run_dir = Path(run_dir)
    tmp = run_dir / f"{name}.{int(tag)}.tmp"
    try:
        recover(run_dir, name)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    except OSError as e:
        raise StateError(f"cannot save {run_dir / name}: {type(e).__name__}: {e}") from None
    _die_if_asked(name, "begin")
    try:
        yield tmp
        _die_if_asked(name, "written")
        _seal(tmp, int(tag))
        _die_if_asked(name, "synced")
        _install(run_dir, name, tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise StateError(f"cannot save {run_dir / name} (through {tmp}): {type(e).__name__}: {e}") from None
        raise


def write_dir_atomically(run_dir: str | Path, name: str, tag: int, writer: Callable[[Path], None]) -> Path:
    """`writer(directory)` fills a fresh directory that becomes `run_dir/name` (see :func:`atomic_dir`)."""
    with atomic_dir(run_dir, name, tag) as d:
        writer(d)
    return Path(run_dir) / name


# ---------------------------------------------------------------------------------------------
# the training state


def _tensors_once(named: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors to save, {alias: saved name}): a tensor that is the same view of the same memory as an
    earlier one (tied weights) is saved once; other tensors that overlap in memory are copied."""
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: dict[tuple, str] = {}
    for k, v in named.items():
        v = v.detach()
        where = (v.device, v.untyped_storage().data_ptr())
        view = (*where, v.storage_offset(), tuple(v.shape), tuple(v.stride()), v.dtype)
        if v.numel() and view in seen:
            aliases[k] = seen[view]
            continue
        seen[view] = k
        shared = v.numel() and where in storages
        storages.setdefault(where, k)
        v = v.contiguous().cpu()
        out[k] = v.clone() if shared or v.untyped_storage().nbytes() != v.numel() * v.element_size() else v
    return out, aliases


def save_state(run_dir: Path, *, step: int, model, opt: torch.optim.Optimizer, sched, ref, rng: random.Random,
               gen: torch.Generator, cost: dict, wall: float, learn_gen: torch.Generator | None = None,
               extra: dict | None = None, extra_tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Write `run_dir/state/` crash-safely (see :func:`atomic_dir`); a StateError if it cannot be written.
    `extra` is any further JSON state (policy version, warning-rule history); `extra_tensors` any further
    named tensors (a learned baseline's critic and optimiser), returned by `load_state` as "extra_tensors"."""
    named: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        named[f"model.{k}"] = v
    if ref is not None:
        for k, v in ref.state_dict().items():
            named[f"ref.{k}"] = v
    opt_sd = opt.state_dict()
    for idx, st in opt_sd["state"].items():
        for name, v in st.items():
            named[f"opt.{idx}.{name}"] = torch.as_tensor(v)
    for k, v in (extra_tensors or {}).items():
        named[f"extra.{k}"] = v
    named["generator"] = gen.get_state()
    if learn_gen is not None:
        named["learn_generator"] = learn_gen.get_state()
    tensors, aliases = _tensors_once(named)
    meta = {
        "step": step,
        "param_groups": opt_sd["param_groups"],
        "sched": {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"},
        "rng": _jsonable(rng.getstate()),
        "cost": cost,
        "wall": wall,
        "aliases": aliases,
        "extra": extra or {},
    }
    with atomic_dir(run_dir, STATE_DIR, tag=step) as tmp:
        save_file(tensors, str(tmp / TENSORS))
        (tmp / META).write_text(json.dumps(meta))


def find_state(run_dir: Path) -> Path | None:
    """The directory holding the newest complete state of a run (`state/` or a leftover of a save
    that was cut off), or None when the run has none."""
    d = find_complete(run_dir, STATE_DIR)
    return d if d is not None and (d / META).exists() else None


def load_state(run_dir: Path, *, model, opt: torch.optim.Optimizer, sched, ref, rng: random.Random,
               gen: torch.Generator, learn_gen: torch.Generator | None = None) -> dict:
    """Restore everything `save_state` wrote, from the newest complete copy; returns {"step", "cost",
    "wall", "dir", "extra", "extra_tensors"}. StateError naming the file when there is no state or it is damaged."""
    d, tensors, meta = _open(Path(run_dir))
    tfile, mfile = d / TENSORS, d / META

    def part(prefix: str) -> dict:
        return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

    try:
        model.load_state_dict(part("model."))
        if ref is not None:
            ref.load_state_dict(part("ref."))
    except RuntimeError as e:
        raise StateError(f"{tfile}: does not fit the model: {' '.join(str(e).split())[:500]}") from None
    state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, idx, name = k.split(".", 2)
            state.setdefault(int(idx), {})[name] = v
    try:
        opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        sched.load_state_dict({**meta["sched"], "lr_lambdas": [None] * len(opt.param_groups)})
        rng.setstate(_tuples(meta["rng"]))
        if "generator" not in tensors:
            raise StateError(f"{tfile}: missing tensor 'generator'")
        gen.set_state(tensors["generator"])
        if learn_gen is not None and "learn_generator" in tensors:
            learn_gen.set_state(tensors["learn_generator"])
        return {"step": int(meta["step"]), "cost": meta["cost"], "wall": float(meta["wall"]), "dir": d,
                "extra": meta.get("extra", {}), "extra_tensors": part("extra.")}
    except KeyError as e:
        raise StateError(f"{mfile}: missing {e.args[0]!r}") from None
    except (ValueError, TypeError, RuntimeError) as e:
        raise StateError(f"{d}: does not fit this run's optimizer or RNG: {type(e).__name__}: {e}") from None


def load_policy_weights(run_dir: str | Path, model) -> int:
    """Load only the policy's weights from the newest complete state of `run_dir` (a run cut off
    before its final checkpoint); returns the step they are from. StateError naming the file."""
    d, tensors, meta = _open(Path(run_dir))
    try:
        model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    except RuntimeError as e:
        raise StateError(f"{d / TENSORS}: does not fit the model: {' '.join(str(e).split())[:500]}") from None
    try:
        return int(meta["step"])
    except (KeyError, TypeError, ValueError):
        raise StateError(f"{d / META}: missing or bad 'step'") from None


def _open(run_dir: Path) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """(directory, tensors with tied aliases filled in, metadata) of the newest complete state."""
    d = find_state(run_dir)
    if d is None:
        raise StateError(f"{run_dir / STATE_DIR}: no saved state")
    verify(d)  # sizes as written: catches truncation before safetensors does
    tensors, meta = _read(d)
    for alias, name in meta.get("aliases", {}).items():
        if name not in tensors:
            raise StateError(f"{d / TENSORS}: no tensor {name!r} (the saved copy of {alias!r})")
        tensors[alias] = tensors[name]
    return d, tensors, meta


def _read(d: Path) -> tuple[dict[str, torch.Tensor], dict]:
    tfile, mfile = d / TENSORS, d / META
    try:
        meta = json.loads(mfile.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StateError(f"{mfile}: missing") from None
    except (OSError, ValueError) as e:
        raise StateError(f"{mfile}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict):
        raise StateError(f"{mfile}: expected a JSON object, got {type(meta).__name__}")
    if not tfile.is_file():
        raise StateError(f"{tfile}: missing")
    try:
        tensors = load_file(str(tfile))
    except Exception as e:  # safetensors raises its own SafetensorError on a damaged file
        raise StateError(f"{tfile}: unreadable ({type(e).__name__}: {e})") from None
    return tensors, meta


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x
