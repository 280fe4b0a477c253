"""A run directory and everything written into it.

    RUN_DIR/config.toml      the resolved config (reload with `rlvr eval RUN_DIR`)
    RUN_DIR/price.json       the price computed before the run started
    RUN_DIR/metrics.jsonl    one row per step, per evaluation and per warning
    RUN_DIR/rollouts.jsonl   a few groups per step: prompt, answer, responses, rewards, Δ
    RUN_DIR/state/           everything `--resume` needs (rlvr.state)
    RUN_DIR/best/            the checkpoint with the best held-out goal so far (a run dir of its own)
    RUN_DIR/snapshots/step-NNNNNN/   the policy every `train.snapshot_every` steps (run dirs of their own)
    RUN_DIR/checkpoint/ or hf/   the final policy
    RUN_DIR/summary.json     final evaluation, counted cost against the price (or, for a run
                             stopped by a signal, `"interrupted": true` and the steps done)

`RunDir` owns these files: the loop hands it rows and models and never opens a file itself.
`--overwrite` replaces only a directory that is a run (config.toml beside price.json or metrics.jsonl)
and deletes only the names above (and rlvr's trackers' and report's directories); it never replaces the
current directory, one above it, the home directory or `/`, and never follows a symbolic --out.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from rlvr import config as config_mod
from rlvr.overwrite import clear_run, overwrite_refusal
from rlvr.checkpoint import save_checkpoint
from rlvr.setup_types import RunError
from rlvr.state import STATE_DIR, atomic_dir, find_complete, find_state

RESUMABLE_KEYS = {"train.steps", "train.threads", "train.save_every", "train.save_every_minutes",
                  "train.snapshot_every", "train.snapshots_keep", "train.price_probes", "train.memory_check",
                  "task.reward_workers", "task.reward_timeout_s", "task.reward_memory_mb", "distributed.learners",
                  "distributed.sharding"}
"""Keys a resumed run may change; sections [eval] and [log] may change too. The price's probes and
the memory check change no update, so a resume may skip what the first start already measured. Note that the
learning-rate schedule is laid out over train.steps, so a longer resumed run decays later (the
resume says so, with the rates: ``schedule_change_note``). The
learner layout may change: every layout makes the one-process update and saves the one-process state."""


def resume_conflicts(saved: config_mod.Config, cfg: config_mod.Config) -> list[str]:
    """Keys whose values differ between a run's saved config and the config it is resumed with."""
    a, b = config_mod.to_dict(saved), config_mod.to_dict(cfg)
    return [f"{sec}.{k}" for sec in a if sec not in ("eval", "log") for k in a[sec]
            if a[sec][k] != b[sec][k] and f"{sec}.{k}" not in RESUMABLE_KEYS]


def schedule_change_note(saved: config_mod.Config, cfg: config_mod.Config, step: int) -> str | None:
    """A line for a run resumed after `step` with another train.steps under a decaying learning-rate
    schedule (rlvr.learn.lr_at): the schedule is laid out over the new length from here on, so the
    next update's rate differs from where the saved run was heading (and from what a run of the new
    length from the start would have used so far). None when nothing changes."""
    from rlvr.learn import lr_at

    a, b = saved.train, cfg.train
    if a.steps == b.steps or b.lr_schedule == "constant":
        return None
    per_step = b.epochs_per_batch * b.minibatches
    opt_step = step * per_step
    old = lr_at(a, opt_step, a.steps * per_step)
    new = lr_at(b, opt_step, b.steps * per_step)
    return (f"note: train.steps changed from {a.steps} to {b.steps} under lr_schedule = {b.lr_schedule!r}: the "
            f"learning rate is laid out over {b.steps} steps from step {step + 1} on, at {new:.3g} x train.lr "
            f"there (the saved run's schedule: {old:.3g} x); steps 1-{step} kept the {a.steps}-step schedule, "
            f"so this run differs from one of {b.steps} steps from the start")


SNAPSHOTS = "snapshots"
"""RUN_DIR's directory of the policy's snapshots (train.snapshot_every)."""


def snapshot_dirs(run_dir: Path) -> list[Path]:
    """RUN_DIR/snapshots/step-NNNNNN directories, oldest first."""
    snaps = Path(run_dir) / SNAPSHOTS
    if not snaps.is_dir():
        return []
    return sorted(d for d in snaps.iterdir() if d.is_dir() and d.name.startswith("step-") and d.name[5:].isdigit())


def snapshot_count(train_cfg) -> int:
    """How many snapshots a run keeps at most: one every `snapshot_every` steps, at most `snapshots_keep`."""
    if not train_cfg.snapshot_every:
        return 0
    made = train_cfg.steps // train_cfg.snapshot_every
    return min(train_cfg.snapshots_keep, made) if train_cfg.snapshots_keep else made


def kept_rows(text: str, last_step: int) -> list[str]:
    """The lines of a JSONL log that hold a row (a JSON object) of a step <= last_step: a half-written
    line, a line that is not an object and the rows written after the last saved state are dropped."""
    keep = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a half-written line (a kill, a full disk)
        if not isinstance(row, dict):
            continue  # not a row rlvr writes
        step = row.get("step", 0)
        if not isinstance(step, (int, float)) or isinstance(step, bool) or step <= last_step:
            keep.append(line)
    return keep


def replace_file(path: Path, data: bytes) -> None:
    """Write `data` as `path` atomically: a temporary file in the same directory, fsynced, then renamed
    over `path` (a kill or a full disk leaves the old file whole). The file keeps the old one's
    permissions (0644 for a new one)."""
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the rows of steps <= last_step (drops what a killed run wrote after its last state; see
    `kept_rows`), rewriting the file atomically (`replace_file`); a LogWriteError when it cannot."""
    if not path.exists():
        return
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
        replace_file(path, "".join(line + "\n" for line in kept_rows(text, last_step)).encode())
    except OSError as e:
        raise LogWriteError(write_failure(path, e)) from None


class LogWriteError(RunError):
    """A run's log (metrics.jsonl, rollouts.jsonl) could not be written: the message names the file, the
    disk and its free space."""


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding `path` (the nearest existing folder's)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def write_failure(path: Path, err: OSError) -> str:
    """Why `path` could not be written, with the free space of its disk (the filesystem the run directory
    is on, named by its mount point)."""
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return (f"cannot write {path}: {err.strerror or err} (errno {err.errno}); the disk holding it (mounted at "
            f"{mount_point(path)}) has {free}")


def _write(fd: int, data: memoryview) -> int:
    """os.write: the one call through which the logs reach the disk."""
    return os.write(fd, data)


class JsonlLog:
    """An append-only JSONL log written a whole batch of lines at a time, unbuffered: a write that fails
    (a full disk) is cut back to the end of the last whole line, so the file never holds a torn row,
    and raises LogWriteError (`write_failure`); nothing stays buffered for `close` to retry."""

    def __init__(self, path: Path, mode: str):
        self.path = Path(path)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "a" else os.O_TRUNC)
        self._fd: int | None = os.open(self.path, flags, 0o644)
        self._end = os.lseek(self._fd, 0, os.SEEK_END)

    @property
    def closed(self) -> bool:
        return self._fd is None

    def write(self, text: str) -> None:
        data = text.encode("utf-8")
        rest = memoryview(data)
        try:
            while rest:
                rest = rest[_write(self._fd, rest):]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._end)
            raise LogWriteError(write_failure(self.path, e)) from None
        self._end += len(data)

    def sync(self) -> None:
        """fsync the file: every row written so far is on the disk."""
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise LogWriteError(write_failure(self.path, e)) from None

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class RunDir:
    """The files of one run; see the module docstring."""

    def __init__(self, path: Path, log=print):
        self.path = Path(path)
        self.log = log
        self._metrics = None
        self._rollouts = None
        self._tracker = None

    # ------------------------------------------------------------------ before the run
    def recorded_autocast(self) -> str | None:
        """"bf16" or "off" as the run's first start chose under model.autocast = auto (its price.json),
        so a resumed run keeps the numerics it started with; None when not recorded."""
        path = self.path / "price.json"
        try:
            price = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        numerics = price.get("numerics", "") if isinstance(price, dict) else None
        if not isinstance(numerics, str):
            raise RunError(f"{path}: damaged: expected a JSON object whose \"numerics\" is a string, got "
                           f"{json.dumps(price)[:80]}; restore the file or delete it")
        return "bf16" if numerics.startswith("bf16") else "off" if numerics.startswith("fp32") else None

    def check_resumable(self, cfg: config_mod.Config) -> config_mod.Config:
        """Refuse --resume on a directory without state, or with a config that changed a key that matters.
        Returns the run's saved config (``schedule_change_note`` reads it once the state is restored)."""
        out = self.path
        if find_state(out) is None or not (out / "config.toml").is_file():
            raise RunError(f"--resume: {out} holds no resumable state ({out / STATE_DIR} is missing)")
        saved = config_mod.load(out / "config.toml")
        conflicts = resume_conflicts(saved, cfg)
        if conflicts:
            raise RunError(f"--resume: the config differs from the run's {out / 'config.toml'} in "
                           f"{', '.join(conflicts)}; only {', '.join(sorted(RESUMABLE_KEYS))}, [eval] and [log] may change")
        return saved

    def check_writable(self) -> None:
        """Refuse an output directory that cannot be written (read-only, full, a file in the way)
        before any model is built: a small file is written, fsynced and removed where the run would
        write (the directory, or the nearest existing folder above it when it does not exist yet)."""
        out = self.path
        if out.is_symlink():
            raise RunError(f"--out {out} is a symbolic link (to {os.readlink(out)}); give the directory itself")
        where = out
        while not where.exists() and where != where.parent:
            where = where.parent
        if not where.is_dir():
            raise RunError(f"--out {out}: {where} is a file, not a directory; choose another path")
        try:
            fd, name = tempfile.mkstemp(prefix=".rlvr-write-check-", dir=where)
            try:
                os.write(fd, b"\0" * 65536)
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(name)
        except OSError as e:
            raise RunError(f"--out {out}: cannot write into {where} ({e.strerror or e}); "
                           f"choose a writable directory with free space") from None

    def check_space(self, price, snapshots: int = 0) -> None:
        """Refuse a run whose saves cannot fit on --out's disk, before anything is written: a state save
        writes a new copy (policy, AdamW moments, reference) beside the old one, and the final
        checkpoint and best/ hold the policy again (each also beside its old copy), as do the
        `snapshots` kept (``snapshot_count``; the newest written beside the others)."""
        state = price.policy_bytes + price.optimizer_bytes + price.reference_bytes
        need = 2 * state + 4 * price.policy_bytes + (snapshots + 1 if snapshots else 0) * price.policy_bytes
        where = self.path
        while not where.exists() and where != where.parent:
            where = where.parent
        free = shutil.disk_usage(where).free
        if free < need:
            mib = 2**20
            raise RunError(f"--out {self.path}: {free / mib:.1f} MiB free on its disk ({where}), but the run's saves "
                           f"need about {need / mib:.1f} MiB (state {state / mib:.1f} MiB written beside the old copy, "
                           f"checkpoint and best/ {price.policy_bytes / mib:.1f} MiB each"
                           + (f", {snapshots} snapshots as much each" if snapshots else "")
                           + "); free space or choose another directory")

    def check_out(self, *, overwrite: bool) -> None:
        """Refuse, before anything is built or deleted, an --out that is a symbolic link or a file, or one
        --overwrite may not replace (`overwrite_refusal`)."""
        out = self.path
        why = overwrite_refusal(out) if overwrite else None
        if why is None and out.is_symlink():
            why = f"--out {out} is a symbolic link (to {os.readlink(out)}); give the directory itself"
        if why is None and out.exists() and not out.is_dir():
            why = f"--out {out} is a file, not a directory; choose another path"
        if why is not None:
            raise RunError(why)

    def prepare(self, *, overwrite: bool) -> None:
        """Refuse to write into an existing run unless told; with --overwrite, delete only the names rlvr
        writes (`clear_run`) in a directory rlvr recognises as a run (`overwrite_refusal`)."""
        out = self.path
        self.check_out(overwrite=overwrite)
        if out.exists() and any(out.iterdir()):
            if not overwrite:
                raise RunError(f"--out {out} already holds files; pass --overwrite to replace them, --resume to "
                               f"continue the run, or choose another directory")
            kept = clear_run(out)
            if kept:
                self.log(f"--overwrite: kept {len(kept)} name(s) rlvr did not write in {out}: {', '.join(kept[:5])}"
                         + (" ..." if len(kept) > 5 else ""))
        out.mkdir(parents=True, exist_ok=True)

    def write_start(self, cfg: config_mod.Config, price) -> None:
        """config.toml and price.json, each replaced atomically (a resumed run's copies stay whole if the
        write is cut off)."""
        replace_file(self.path / "config.toml", config_mod.to_toml(cfg).encode())
        replace_file(self.path / "price.json", json.dumps(price.to_dict(), indent=2).encode())

    def open_logs(self, cfg: config_mod.Config, *, resume_after: int | None) -> None:
        """Open metrics.jsonl, rollouts.jsonl and the trackers the config asks for (rlvr.tracking);
        on resume, drop rows written after the saved step."""
        from rlvr import tracking

        self._tracker = tracking.open_trackers(cfg.log, self.path, config_mod.to_dict(cfg))
        mode = "w"
        if resume_after is not None:
            for name in ("metrics.jsonl", "rollouts.jsonl"):
                truncate_jsonl(self.path / name, resume_after)
            mode = "a"
        self._metrics = JsonlLog(self.path / "metrics.jsonl", mode)
        self._rollouts = JsonlLog(self.path / "rollouts.jsonl", mode)

    # ------------------------------------------------------------------ during the run
    def metrics(self, row: dict) -> None:
        """Append one row to metrics.jsonl (a LogWriteError naming the disk when it cannot)."""
        self._metrics.write(json.dumps(row) + "\n")
        if self._tracker is not None and "step" in row:
            self._tracker.log(row["step"], row)

    def warn(self, step: int, msg: str) -> None:
        self.log(f"warning: step {step}: {msg}")
        self.metrics({"step": step, "warning": msg})

    def rollouts(self, step: int, groups, delta, n: int) -> None:
        """The first `n` groups of the step: prompt, answer, responses, rewards and Δ."""
        G = groups.rewards.shape[1]
        self._rollouts.write("".join(json.dumps({
            "step": step, "prompt": groups.examples[g].prompt, "answer": str(groups.examples[g].answer),
            "responses": groups.responses[g * G:(g + 1) * G], "rewards": groups.rewards[g].tolist(),
            "delta": delta[g].tolist(),
        }) + "\n" for g in range(min(n, len(groups.examples)))))

    def sync_logs(self) -> None:
        """fsync metrics.jsonl and rollouts.jsonl: called before a state save, which refers to their rows."""
        for f in (self._metrics, self._rollouts):
            if f is not None and not f.closed:
                f.sync()

    def load_best(self) -> dict:
        d = find_complete(self.path, "best")
        return json.loads((d / "best.json").read_text()) if d is not None and (d / "best.json").is_file() else {}

    def save_best(self, model, tok, cfg: config_mod.Config, best: dict) -> None:
        """RUN_DIR/best: the checkpoint with the highest held-out goal so far, a run directory of its own
        (config.toml, checkpoint/ or hf/, best.json) that `rlvr eval RUN_DIR/best` reloads. Written
        beside, fsynced and renamed into place, so an interrupted save keeps the previous best."""
        with atomic_dir(self.path, "best", tag=best["step"]) as d:
            save_checkpoint(d, model, tok, tag=best["step"])
            (d / "config.toml").write_text(config_mod.to_toml(cfg))
            (d / "best.json").write_text(json.dumps(best, indent=2))

    def save_snapshot(self, model, tok, cfg: config_mod.Config, step: int) -> None:
        """RUN_DIR/snapshots/step-NNNNNN: the policy after `step` (train.snapshot_every), a run directory
        of its own like best/ (`rlvr eval` reloads it). Written beside, fsynced and renamed into place;
        then all but the newest `train.snapshots_keep` (0: all) are deleted, each renamed away first so
        that a kill in the middle leaves no partial snapshot under a snapshot's name."""
        snaps = self.path / SNAPSHOTS
        with atomic_dir(snaps, f"step-{step:06d}", tag=step) as d:
            save_checkpoint(d, model, tok, tag=step)
            (d / "config.toml").write_text(config_mod.to_toml(cfg))
        keep = cfg.train.snapshots_keep
        for old in (snapshot_dirs(self.path)[:-keep] if keep else []):
            gone = old.with_name(old.name + ".deleting")
            os.replace(old, gone)
            shutil.rmtree(gone)
        for gone in snaps.glob("*.deleting"):       # left by a kill during a deletion
            shutil.rmtree(gone, ignore_errors=True)

    # ------------------------------------------------------------------ at the end
    def finish(self, model, tok, summary: dict, step: int) -> None:
        save_checkpoint(self.path, model, tok, tag=step)
        self.write_summary(summary)

    def write_summary(self, summary: dict) -> None:
        """Close the logs and write summary.json (beside, then renamed over the old one)."""
        self.close()
        tmp = self.path / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, self.path / "summary.json")

    def close(self) -> None:
        for f in (self._metrics, self._rollouts):
            if f is not None and not f.closed:
                f.close()
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None
