"""Reading a run directory for `rlvr report`, tolerantly: a half-written last line is skipped with a
warning, absent files are None; a run's files are read without following symbolic links."""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ReportError(ValueError):
    """Bad input to `rlvr report`, with the path (and line) in the message."""


@dataclass
class RunRecords:
    """What a run directory holds, read tolerantly."""

    run_dir: Path
    train: list[dict] = field(default_factory=list)      # metrics rows with train/* keys
    eval: list[dict] = field(default_factory=list)       # metrics rows with eval/* keys
    rollouts: list[dict] = field(default_factory=list)
    config_text: str | None = None
    price: dict | None = None                            # price.json, else summary.json's "price"
    summary: dict | None = None                          # None while the run is going or was cut off
    warnings: list[str] = field(default_factory=list)            # problems reading the run
    price_source: str | None = None
    run_warnings: list[tuple] = field(default_factory=list)      # (step, message): what the run warned about

    @property
    def name(self) -> str:
        return self.run_dir.name or str(self.run_dir)

    @property
    def config(self) -> dict:
        """config.toml parsed ({} when absent or unreadable)."""
        if not self.config_text:
            return {}
        try:
            return tomllib.loads(self.config_text)
        except tomllib.TOMLDecodeError:
            return {}

    @property
    def finished(self) -> bool:
        """A summary.json that is not one written by a run stopped with Ctrl-C / SIGTERM."""
        return self.summary is not None and not self.summary.get("interrupted")

    @property
    def last_step(self) -> int | None:
        steps = [r["step"] for r in self.train + self.eval if _num(r.get("step"))]
        return max(steps) if steps else None


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v == int(v) and abs(v) < 1e15:
            return f"{int(v):,}"
        return f"{v:,.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
    return str(v)


def is_own_file(path: Path) -> bool:
    """True when `path` is a regular file itself, not a symbolic link (to anything) or a directory."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def read_own_text(path: Path) -> str:
    """The text of the run's file `path`, opened without following a symbolic link (O_NOFOLLOW) and only
    when it is a regular file: a run directory is data, and a link in it could point at any file
    (a key, a secret) that the page, which is meant to be shared, would then embed. OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            return f.read().decode("utf-8", errors="replace")
    finally:
        if fd >= 0:
            os.close(fd)


def _linked(path: Path) -> str | None:
    """A warning for a run file that is a symbolic link (never read), else None."""
    if not path.is_symlink():
        return None
    return f"{path} is a symbolic link (to {os.readlink(path)}); a run's files are read only when they are its own, so it was skipped"


def _read_jsonl(path: Path, warnings: list[str]) -> list[dict]:
    """Rows of a JSONL file. An unparseable last line is dropped (half-written); any other is an error."""
    try:
        text = read_own_text(path)
    except OSError as e:
        raise ReportError(f"cannot read {path}: {e.strerror or e}") from None
    lines = text.split("\n")
    numbered = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip()]
    rows = []
    for k, (lineno, ln) in enumerate(numbered):
        try:
            row = json.loads(ln)
            if not isinstance(row, dict):
                raise ValueError(f"expected a JSON object, got {type(row).__name__}")
        except ValueError as e:
            if k == len(numbered) - 1:
                warnings.append(f"{path}:{lineno}: ignored an unparseable last line (half-written: the run is "
                                f"still going or was cut off)")
                break
            raise ReportError(f"{path}:{lineno}: corrupt line ({e}); only the last line may be half-written") from None
        rows.append(row)
    return rows


def _read_json(path: Path, warnings: list[str]) -> dict | None:
    if _linked(path):
        warnings.append(_linked(path))
        return None
    if not is_own_file(path):
        return None
    try:
        obj = json.loads(read_own_text(path))
    except (OSError, ValueError) as e:
        warnings.append(f"{path}: unreadable ({e}); ignored")
        return None
    if not isinstance(obj, dict):
        warnings.append(f"{path}: expected a JSON object; ignored")
        return None
    return obj


def load_run_records(run_dir) -> RunRecords:
    """Read RUN_DIR's config.toml, metrics.jsonl, rollouts.jsonl, price.json, summary.json."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ReportError(f"run directory {run_dir} does not exist")
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory; expected a run directory (rlvr train --out)")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_symlink():
        raise ReportError(f"{metrics} is a symbolic link (to {os.readlink(metrics)}); a run's files are read only "
                          f"when they are its own, never through a link")
    if not metrics.is_file():
        what = "is empty" if not any(run_dir.iterdir()) else "has no metrics.jsonl"
        raise ReportError(f"{run_dir} {what}; expected a run directory written by `rlvr train`")
    rec = RunRecords(run_dir=run_dir)
    for row in _read_jsonl(metrics, rec.warnings):
        if isinstance(row.get("warning"), str):
            rec.run_warnings.append((row.get("step"), row["warning"]))
        is_train = any(k.startswith("train/") for k in row)
        is_eval = any(k.startswith("eval/") for k in row)
        if not _num(row.get("step")):
            if is_train or is_eval:
                rec.warnings.append(f"{metrics}: a row without a numeric 'step' was skipped")
            continue
        if is_train:
            rec.train.append(row)
        if is_eval:
            rec.eval.append(row)
    if not rec.train and not rec.eval:
        raise ReportError(f"{metrics} has no metrics rows yet (empty, or only a half-written line); "
                          f"nothing to report")
    rollouts = run_dir / "rollouts.jsonl"
    cfg = run_dir / "config.toml"
    for linked in (_linked(rollouts), _linked(cfg)):
        if linked:
            rec.warnings.append(linked)
    if is_own_file(rollouts):
        rec.rollouts = [r for r in _read_jsonl(rollouts, rec.warnings) if isinstance(r.get("responses"), list)]
    if is_own_file(cfg):
        try:
            rec.config_text = read_own_text(cfg)
        except OSError as e:
            rec.warnings.append(f"{cfg}: unreadable ({e})")
    rec.summary = _read_json(run_dir / "summary.json", rec.warnings)
    rec.price = _read_json(run_dir / "price.json", rec.warnings)
    if rec.price is not None:
        rec.price_source = "price.json"
    elif rec.summary is not None and isinstance(rec.summary.get("price"), dict):
        rec.price, rec.price_source = rec.summary["price"], "summary.json (price)"
    return rec
