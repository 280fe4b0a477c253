"""What `rlvr report` writes (the PNG names and report.html) and how: each file through a fresh
temporary file renamed into place, in an output directory checked to be a real directory."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from rlvr.report.records import ReportError

HTML_NAME = "report.html"

# (file name, title, y label, [(metric key, legend label)]); eval series are added to the first plot.
PLOTS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("reward.png", "Reward and goal", "rate / reward",
     [("train/reward", "train reward"), ("train/goal", "train goal")]),
    ("nonzero_delta.png", "Usable signal: non-zero Δ and agreeing groups", "fraction",
     [("train/nonzero_delta_frac", "non-zero Δ fraction"), ("train/agreeing_groups_frac", "agreeing groups fraction")]),
    ("kl.png", "KL", "KL",
     [("train/approx_kl_old", "approx KL to π_old"), ("train/kl_ref", "KL to π_ref")]),
    ("entropy.png", "Sampling entropy (per token)", "nats",
     [("train/entropy", "entropy")]),
    ("response_len.png", "Response length", "tokens",
     [("train/response_len", "mean response length")]),
    ("tool_calls.png", "Tool calls (runs with sampling.max_tool_calls)", "calls per response",
     [("train/tool_calls_per_response", "tool calls per response")]),
]
EVAL_SERIES = [("eval/goal", "held-out goal"), ("eval/reward", "held-out reward")]
OUTPUT_NAMES = frozenset([HTML_NAME, *(p[0] for p in PLOTS)])


def _check_writable(path: Path) -> None:
    """Only regular files of our own names are replaced; never follow a link or replace a directory."""
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise ReportError(f"{path} exists and is not a regular file; refusing to overwrite it")


def _check_out_dir(out: Path) -> None:
    """Refuse an output directory that is a symbolic link (the page would land wherever it points), a file,
    or one holding a link or a directory under one of the names the report writes."""
    if out.is_symlink():
        raise ReportError(f"{out} is a symbolic link (to {os.readlink(out)}); the report writes only into a real "
                          f"directory: remove the link or pass --out DIR")
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out} is a file, not a directory; choose another path")
    for name in OUTPUT_NAMES:
        _check_writable(out / name)


def make_out_dir(out: Path) -> None:
    """Create `out` (and its parents) and check, after creating it, that it is a real directory (not a link)."""
    _check_out_dir(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"cannot create {out}: {e.strerror or e}") from None
    _check_out_dir(out)


def write_replacing(out: Path, name: str, write) -> Path:
    """`out/name` written whole: `write(file)` fills a fresh file made by `tempfile.mkstemp` in the checked
    directory `out`, which is then renamed over `out/name` (a link or directory there is refused, never
    followed). A stale temporary name, or a link planted under one, is never opened."""
    final = out / name
    _check_writable(final)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)
        _check_writable(final)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return final


def default_out(run_dirs: list) -> Path:
    """RUN_DIR/report for one run; beside the first run, compare-A-vs-B..., for several."""
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / "report"
    first = Path(run_dirs[0])
    return first.parent / ("compare-" + "-vs-".join(Path(d).name or "run" for d in run_dirs))[:120]
