"""`rlvr report RUN_DIR [RUN_DIR ...] [--out DIR]`: PNG plots and one self-contained HTML page.

Works on a finished run, one still going, or one that was cut off: the last line of a JSONL file
may be half-written (it is ignored, with a warning), summary.json / price.json / checkpoint/ may be
absent. A corrupt line anywhere but the last is an error naming file:line. With several run
directories the plots overlay the runs (one colour per run) and the page compares them.

    records = load_run_records(run_dir)       # RunRecords; ReportError on bad input
    specs, notes = plan_plots([records, ...]) # what each PNG will show, and what is left out and why
    pngs = plot([records, ...], out_dir)      # list[Path] (matplotlib, Agg canvas, imported here)
    html = render_html(records, pngs)         # str: PNGs embedded as data: URIs, no external assets
    html = render_compare_html(runs, pngs)    # the same for several runs
    command(args) -> int                      # the CLI entry point; prints the paths it wrote

What is plotted: each figure has two panels, against training steps and against sampled tokens
(the cost axis), and the held-out evaluations (a step-0 evaluation included) on the reward plot.
Left out, with the reason written on the page: KL to π_old when it is zero by construction (one
update per batch: the update starts from the policy that sampled), and a series that never changes
(response length on a fixed-length task, say). The run's own warnings (the `warning` rows of
metrics.jsonl) are listed with their step.

Each PNG carries what it shows in a `rlvr:series` text chunk (JSON read back from the drawn
matplotlib lines: per panel its x axis and every line's label, x and y), so a test or a script can
check a plot from the file alone (`read_png_series`).

Files written (and the only ones ever overwritten): report.html and the PNG names in PLOTS (tool_calls.png only
for runs with tool calls), each through a fresh ``tempfile.mkstemp`` file renamed into place, in an output
directory that is checked to be a real directory (a symbolic link there is refused). A run directory is
data: its files are read without following symbolic links (O_NOFOLLOW); a linked metrics.jsonl is refused,
any other linked file is skipped with a warning, so a page meant to be shared never embeds a file from
outside the run.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import html
import json
import math
import os
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

INSTALL_HINT = 'pip install "rlvr[report]"'
HTML_NAME = "report.html"
ROLLOUT_STEPS = 3        # latest steps whose groups are shown
ROLLOUT_GROUPS = 12      # at most this many groups in the table
RESPONSE_CHARS = 400     # longer responses are cut in the table (the rest is model output nobody reads)

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


# --------------------------------------------------------------------------- loading


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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


# --------------------------------------------------------------------------- plots


def _x_axis(records: RunRecords) -> tuple[str, dict[int, float]]:
    """x label and {step: x}. x = train/sampled_tokens; falls back to the step when no row has it."""
    by_step = {r["step"]: r["train/sampled_tokens"] for r in records.train if _num(r.get("train/sampled_tokens"))}
    if by_step:
        return "sampled tokens", by_step
    return "step", {r["step"]: r["step"] for r in records.train + records.eval}


def _x_of(step, by_step: dict, label: str):
    """x of an eval row: the sampled tokens of its step (or of the latest train step before it)."""
    if step in by_step:
        return by_step[step]
    if label == "step":
        return step
    before = [s for s in by_step if s <= step]
    return by_step[max(before)] if before else 0


def _series(rows: list[dict], key: str, by_step: dict, label: str) -> tuple[list, list]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if _num(v):
            xs.append(_x_of(r["step"], by_step, label))
            ys.append(v)
    return xs, ys


def _import_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ReportError(f"rlvr report needs matplotlib ({e}); install it with: {INSTALL_HINT}") from None
    return Figure, FigureCanvasAgg


KL_OLD_KEYS = ("train/approx_kl_old", "train/approx_kl")
ALWAYS_SHOWN = ("reward.png",)   # a flat reward or goal is the news (nothing moves); other flat series are dropped


@dataclass
class Series:
    """One plotted line: its values against steps and (when the run counts them) sampled tokens."""

    run: str
    key: str
    label: str
    steps: list
    tokens: list | None
    ys: list
    eval: bool = False


@dataclass
class PlotSpec:
    """One PNG: its file name, title, y label and the series it shows."""

    name: str
    title: str
    ylabel: str
    series: list


def kl_old_zero_reason(records: RunRecords) -> str | None:
    """Why KL to π_old is zero by construction in this run, or None when it is not.

    From the resolved config: with train.epochs_per_batch = 1 and train.minibatches = 1 each batch
    gets one update, which starts from the very policy that sampled it. Without a config, from the
    data: every logged value below 1e-9.
    """
    train = records.config.get("train")
    if isinstance(train, dict):
        if train.get("epochs_per_batch", 1) == 1 and train.get("minibatches", 1) == 1:
            return ("one update per batch (train.epochs_per_batch = 1, train.minibatches = 1): the update starts "
                    "from the policy that sampled the batch, so KL to π_old is 0 by construction (float noise "
                    "only)")
        return None
    vals = [abs(r[k]) for r in records.train for k in KL_OLD_KEYS if _num(r.get(k))]
    if vals and max(vals) < 1e-9:
        return f"every logged value is below 1e-9 (largest {max(vals):.1e}): zero up to float noise"
    return None


def _flat(ys: list) -> bool:
    """Two or more values, all equal up to a relative 1e-9 (a constant series carries no information)."""
    return len(ys) >= 2 and max(ys) - min(ys) <= 1e-9 * max(abs(y) for y in ys)


def _make_series(rec: RunRecords, rows: list[dict], key: str, label: str, run: str, is_eval: bool) -> Series:
    _, by_step = _x_axis(rec)
    has_tokens = any(_num(r.get("train/sampled_tokens")) for r in rec.train)
    steps, tokens, ys = [], [], []
    for r in rows:
        v = r.get(key)
        if _num(v):
            steps.append(r["step"])
            tokens.append(_x_of(r["step"], by_step, "sampled tokens"))
            ys.append(v)
    return Series(run=run, key=key, label=label, steps=steps, tokens=tokens if has_tokens else None, ys=ys,
                  eval=is_eval)


def plan_plots(runs: list[RunRecords]) -> tuple[list[PlotSpec], list[str]]:
    """What each PNG shows (specs with data), and a note for every series left out and why."""
    specs, notes = [], []
    many = len(runs) > 1
    for name, title, ylabel, keys in PLOTS:
        series = []
        for rec in runs:
            run = rec.name if many else ""
            prefix = f"{rec.name}: " if many else ""
            for key, lab in keys:
                s = _make_series(rec, rec.train, key, lab, run, False)
                if not s.ys:
                    continue
                if key in KL_OLD_KEYS:
                    reason = kl_old_zero_reason(rec)
                    if reason:
                        notes.append(f"{prefix}{lab}: not plotted: {reason}.")
                        continue
                if name not in ALWAYS_SHOWN and _flat(s.ys):
                    notes.append(f"{prefix}{lab}: not plotted: constant at {_fmt(s.ys[0])} over {len(s.ys)} steps "
                                 f"(e.g. the response length of a fixed-length task).")
                    continue
                series.append(s)
            if name == "reward.png":
                series += [s for k, lab in EVAL_SERIES
                           if (s := _make_series(rec, rec.eval, k, lab, run, True)).ys]
        if series:
            specs.append(PlotSpec(name, title, ylabel, series))
    return specs, notes


LINE_STYLES = ("-", "--", ":", "-.")


def _plotted(fig, spec: PlotSpec, panels: list[str]) -> str:
    """JSON of what the figure's axes really hold: per panel its x label and every line's label and
    data, read back from matplotlib's Line2D objects (not from the spec that asked for them)."""
    axes = []
    for ax, panel in zip(fig.axes, panels):
        lines = [{"label": ln.get_label(), "x": [float(x) for x in ln.get_xdata()],
                  "y": [float(y) for y in ln.get_ydata()]} for ln in ax.get_lines()]
        axes.append({"x": panel, "xlabel": ax.get_xlabel(), "title": ax.get_title(), "lines": lines})
    return json.dumps({"plot": spec.name, "panels": axes}, ensure_ascii=True, separators=(",", ":"))


def _draw(spec: PlotSpec, runs: list[str], Figure, FigureCanvasAgg):
    """A figure with a panel against steps and, when counted, one against sampled tokens."""
    panels = ["step"] + (["sampled tokens"] if any(s.tokens for s in spec.series) else [])
    fig = Figure(figsize=(5.2 * len(panels) + 0.8, 4), dpi=100)
    FigureCanvasAgg(fig)
    keys = list(dict.fromkeys(s.key for s in spec.series))
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for j, s in enumerate(spec.series):
            xs = s.steps if panel == "step" else s.tokens
            if not xs:
                continue
            label = f"{s.run}: {s.label}" if s.run else s.label
            if len(runs) > 1:  # one colour per run, one line style per metric
                color = f"C{runs.index(s.run) % 10}"
                style = "o--" if s.eval else LINE_STYLES[keys.index(s.key) % len(LINE_STYLES)]
            else:
                color, style = f"C{j % 10}", "o--" if s.eval else "-"
            ax.plot(xs, s.ys, style, color=color, label=label, markersize=4, linewidth=1.4)
        ax.set_title(spec.title if len(panels) == 1 else f"{spec.title} (by {panel})", fontsize="medium")
        ax.set_xlabel(panel)
        ax.set_ylabel(spec.ylabel)
        ax.grid(True, alpha=0.3)
        if i == len(panels) - 1:
            ax.legend(loc="best", fontsize="x-small")
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.13, top=0.9, wspace=0.25)  # fixed: tight_layout draws twice
    return fig, panels


def plot(runs, out_dir) -> list[Path]:
    """Write one PNG per plot that has data into out_dir (created if needed); return their paths.

    `runs` is one RunRecords or a list of them (overlaid). Uses matplotlib's Agg canvas directly
    (no pyplot, no global backend switch). Each PNG carries its data in a `rlvr:series` text chunk.
    """
    runs = [runs] if isinstance(runs, RunRecords) else list(runs)
    Figure, FigureCanvasAgg = _import_matplotlib()
    out_dir = Path(out_dir)
    make_out_dir(out_dir)
    specs, _ = plan_plots(runs)
    names = [r.name for r in runs] if len(runs) > 1 else [""]
    written = []
    for spec in specs:
        fig, panels = _draw(spec, names, Figure, FigureCanvasAgg)
        series = _plotted(fig, spec, panels)
        written.append(write_replacing(out_dir, spec.name,
                                       lambda f: fig.savefig(f, format="png", metadata={"rlvr:series": series})))
    return written


def read_png_series(path) -> dict:
    """What a PNG written by `plot` shows: {"plot", "panels": [{"x", "xlabel", "title", "lines":
    [{"label", "x", "y"}]}]}, from its `rlvr:series` text chunk (read with Pillow)."""
    from PIL import Image

    with Image.open(path) as img:
        img.load()
        return json.loads(img.text["rlvr:series"])


# --------------------------------------------------------------------------- HTML


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


def _e(v) -> str:
    return html.escape(v if isinstance(v, str) else _fmt(v), quote=True)


def _table(head: list[str] | None, rows: list[list[str]], cls: str = "") -> str:
    """rows hold already-escaped cell HTML."""
    h = "<thead><tr>" + "".join(f"<th>{_e(c)}</th>" for c in head) + "</tr></thead>" if head else ""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}">{h}<tbody>{body}</tbody></table>'


RATIOS = ("cost/wall_vs_estimate", "cost/steps_vs_expected", "cost/wall_vs_expected")
"""summary.json's counted / priced ratios: shown as the cost table's ratio column, not as rows."""


def cost_rows(records: RunRecords) -> list[tuple[str, object, object]]:
    """(figure X, price of X_per_run or None, counted cost/X or None), matched by name.

    A counted figure without a price, and a price without a count, each get a row. The wall time is
    the counted `wall_seconds` against the price's `wall_seconds_estimate` (its ratio is the
    summary's `cost/wall_vs_estimate`, so that is not a row of its own). When the price measured a
    decode step, its `wall_seconds_expected` (which prices the steps only) is set against the
    counted `step_seconds` (the row `step_seconds`; ratio `cost/steps_vs_expected`); a run that
    predates `step_seconds` has it against its whole wall time instead (the row
    `wall_seconds_expected`, ratio `cost/wall_vs_expected`). Before cost/* keys existed,
    summary.json carried the counted sampled tokens as `sampled_tokens`; that is used for
    `sampled_tokens` when `cost/sampled_tokens` is absent."""
    price = records.price or {}
    summary = records.summary or {}
    priced = {k[: -len("_per_run")]: v for k, v in price.items() if k.endswith("_per_run")}
    counted = {k[len("cost/"):]: v for k, v in summary.items() if k.startswith("cost/") and k not in RATIOS}
    expected_as = "step_seconds" if "step_seconds" in counted else "wall_seconds_expected"
    for key, name in (("wall_seconds_estimate", "wall_seconds"), ("wall_seconds_expected", expected_as)):
        if _num(price.get(key)) and price[key] > 0:
            priced[name] = price[key]
    if expected_as == "wall_seconds_expected" and "wall_seconds_expected" in priced and "wall_seconds" in counted:
        counted["wall_seconds_expected"] = counted["wall_seconds"]
    if "sampled_tokens" not in counted and _num(summary.get("sampled_tokens")):
        counted["sampled_tokens"] = summary["sampled_tokens"]
    names = list(priced) + [k for k in counted if k not in priced]
    return [(n, priced.get(n), counted.get(n)) for n in names]


def _cost_section(records: RunRecords) -> str:
    rows = cost_rows(records)
    parts = ["<h2>Price against counted cost</h2>"]
    if records.price is None:
        parts.append("<p>No price recorded (no price.json; the run predates it).</p>")
    else:
        parts.append(f"<p>Price from {_e(records.price_source or 'price.json')}: upper bounds set before the run.</p>")
    if not records.finished:
        why = "it was interrupted" if records.summary is not None else "no summary.json"
        parts.append(f'<p class="warn">run not finished: {why}, so nothing is counted yet.</p>')
    if rows:
        body = []
        for name, p, c in rows:
            if c is None:
                c_cell = "run not finished" if not records.finished else "not counted"
            else:
                c_cell = _e(c)
            ratio = _e(c / p) if _num(c) and _num(p) and p else ""
            body.append([_e(name), _e(p) if p is not None else "no price", c_cell, ratio])
        parts.append(_table(["figure", "price (per run)", "counted", "counted / price"], body, "num"))
    other = {k: v for k, v in (records.price or {}).items() if not k.endswith("_per_run")}
    if other:
        parts.append("<details><summary>other price figures</summary>"
                     + _table(["field", "value"], [[_e(k), _e(v)] for k, v in other.items()], "num")
                     + "</details>")
    return "\n".join(parts)


def _eval_section(records: RunRecords) -> str:
    parts = ["<h2>Held-out evaluation</h2>"]
    if records.summary is not None and any(k.startswith("eval/") for k in records.summary):
        title, figs = "final (summary.json)", {k: v for k, v in records.summary.items() if k.startswith("eval/")}
    elif records.eval:
        last = records.eval[-1]
        title = f"latest (step {last['step']}; run not finished)" if not records.finished \
            else f"latest (step {last['step']})"
        figs = {k: v for k, v in last.items() if k.startswith("eval/")}
    else:
        return "\n".join(parts + ["<p>No evaluation yet.</p>"])
    parts.append(f"<p>{_e(title)}</p>")
    parts.append(_table(["figure", "value"], [[_e(k), _e(v)] for k, v in figs.items()], "num"))
    if records.eval:
        keys = []
        for r in records.eval:
            keys += [k for k in r if k.startswith("eval/") and k not in keys]
        label, by_step = _x_axis(records)
        rows = [[_e(str(r["step"])), _e(_x_of(r["step"], by_step, label))] + [_e(r[k]) if k in r else "" for k in keys]
                for r in records.eval]
        parts.append("<details><summary>every evaluation</summary>"
                     + _table(["step", label, *keys], rows, "num") + "</details>")
    return "\n".join(parts)


def _cut(s: str) -> str:
    return s if len(s) <= RESPONSE_CHARS else s[:RESPONSE_CHARS] + f"… ({len(s) - RESPONSE_CHARS} more chars)"


def _rollout_section(records: RunRecords) -> str:
    parts = ["<h2>Sample rollouts</h2>"]
    steps = sorted({r.get("step") for r in records.rollouts if _num(r.get("step"))})[-ROLLOUT_STEPS:]
    groups = [r for r in records.rollouts if r.get("step") in steps][-ROLLOUT_GROUPS:]
    if not groups:
        return "\n".join(parts + ["<p>No rollouts recorded.</p>"])
    parts.append(f"<p>The latest {len(groups)} groups (steps {_e(', '.join(str(s) for s in steps))}): "
                 f"each prompt with all its responses, their rewards and Δ.</p>")
    rows = []
    for g in groups:
        resp = g.get("responses") or []
        rewards, delta = g.get("rewards") or [], g.get("delta") or []
        n = max(1, len(resp))
        for i in range(n):
            cells = []
            if i == 0:
                span = f' rowspan="{n}"'
                cells = [f'<td{span}>{_e(str(g.get("step", "")))}</td>',
                         f'<td{span}><code>{_e(str(g.get("prompt", "")))}</code></td>',
                         f'<td{span}><code>{_e(str(g.get("answer", "")))}</code></td>']
            r = _e(_cut(str(resp[i]))) if i < len(resp) else ""
            rw = _e(rewards[i]) if i < len(rewards) else ""
            d = _e(delta[i]) if i < len(delta) else ""
            cls = ' class="zero"' if i < len(delta) and _num(delta[i]) and delta[i] == 0 else ""
            cells += [f"<td><code>{r}</code></td>", f"<td>{rw}</td>", f"<td{cls}>{d}</td>"]
            rows.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ["step", "prompt", "answer", "response", "reward", "Δ"])
    parts.append(f'<table class="rollouts"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>')
    return "\n".join(parts)


CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .5em 0; font-size: .9em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
table.num td + td { text-align: right; font-variant-numeric: tabular-nums; }
td.zero { color: #999; }
pre { background: #f6f6f6; padding: .8em; overflow-x: auto; font-size: .85em; }
code { white-space: pre-wrap; word-break: break-all; }
.warn { color: #a60; } .plots img { max-width: 100%; display: block; margin: .5em 0; }
"""


def _run_warnings_section(runs: list[RunRecords]) -> str:
    parts = ["<h2>Warnings the run printed</h2>" if len(runs) == 1 else "<h2>Warnings the runs printed</h2>"]
    rows = [([_e(r.name)] if len(runs) > 1 else []) + [_e(str(step)), _e(msg)]
            for r in runs for step, msg in r.run_warnings]
    if not rows:
        return "\n".join(parts + ["<p>None.</p>"])
    head = (["run"] if len(runs) > 1 else []) + ["step", "warning"]
    parts.append(f"<p>{len(rows)} warning{'s' if len(rows) != 1 else ''} (from metrics.jsonl), each naming a fix.</p>")
    parts.append(_table(head, rows, "warnings"))
    return "\n".join(parts)


def _plots_section(pngs: list, notes: list[str]) -> str:
    parts = ['<h2>Plots</h2><p>Each figure: against training steps (left) and against sampled tokens, what the '
             'run paid (right).</p><div class="plots">']
    if not pngs:
        parts.append("<p>No plots.</p>")
    for p in pngs:
        p = Path(p)
        data = base64.b64encode(p.read_bytes()).decode("ascii")
        parts.append(f'<img alt="{_e(p.stem)}" src="data:image/png;base64,{data}">')
    parts.append("</div>")
    if notes:
        parts.append('<p>Not plotted:</p><ul class="notes">' + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    return "\n".join(parts)


def step0_goal(records: RunRecords):
    """The held-out goal of a step-0 evaluation (before any update), or None."""
    return next((r.get("eval/goal") for r in records.eval if r.get("step") == 0 and _num(r.get("eval/goal"))), None)


def render_html(records: RunRecords, pngs: list) -> str:
    """One self-contained page: every PNG inline as a data: URI, every string from the run escaped."""
    title = f"rlvr report: {records.run_dir.name or records.run_dir}"
    last = records.train[-1] if records.train else {}
    status = ("finished" if records.finished else
              "interrupted (Ctrl-C or SIGTERM; continue it with rlvr train --resume)" if records.summary is not None
              else "not finished (running, or cut off): no summary.json")
    facts = [("run directory", str(records.run_dir)), ("status", status),
             ("last step", str(records.last_step)), ("training rows", len(records.train)),
             ("evaluation rows", len(records.eval))]
    if _num(last.get("train/sampled_tokens")):
        facts.append(("sampled tokens so far", last["train/sampled_tokens"]))
    if records.summary and _num(records.summary.get("wall_seconds")):
        facts.append(("wall seconds", records.summary["wall_seconds"]))
    if step0_goal(records) is not None:
        facts.append(("held-out goal at step 0 (before training)", step0_goal(records)))
    facts.append(("warnings the run printed", len(records.run_warnings)))
    facts.append(("checkpoint", "present" if (records.run_dir / "checkpoint").is_dir() else "absent"))
    facts.append(("generated", time.strftime("%Y-%m-%d %H:%M:%S")))
    parts = [f"<h1>{_e(title)}</h1>", _table(None, [[_e(k), _e(v)] for k, v in facts])]
    if records.warnings:
        parts.append('<ul class="warn">' + "".join(f"<li>{_e(w)}</li>" for w in records.warnings) + "</ul>")
    parts.append(_plots_section(pngs, plan_plots([records])[1]))
    parts.append(_run_warnings_section([records]))
    parts.append(_eval_section(records))
    parts.append(_cost_section(records))
    parts.append(_rollout_section(records))
    parts.append("<h2>Config</h2>")
    parts.append(f"<pre>{_e(records.config_text)}</pre>" if records.config_text is not None
                 else "<p>No config.toml.</p>")
    body = "\n".join(parts)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{CSS}</style></head>\n<body>\n{body}\n</body></html>\n")


def _final_goal(r: RunRecords):
    if r.summary is not None and _num(r.summary.get("eval/goal")):
        return r.summary["eval/goal"]
    return r.eval[-1].get("eval/goal") if r.eval else None


def config_differences(runs: list[RunRecords]) -> list[tuple[str, list]]:
    """(section.key, [value in each run]) for every config key whose value differs between runs."""
    flat = []
    for r in runs:
        cfg = r.config
        flat.append({f"{sec}.{k}": v for sec, tab in cfg.items() if isinstance(tab, dict) for k, v in tab.items()})
    keys = list(dict.fromkeys(k for f in flat for k in f))
    return [(k, [f.get(k) for f in flat]) for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1]


def render_compare_html(runs: list[RunRecords], pngs: list) -> str:
    """One self-contained page comparing several runs: a row of figures per run, the config keys
    that differ, the overlaid plots, and every run's warnings."""
    title = "rlvr report: " + " vs ".join(r.name for r in runs)
    head = ["run", "status", "last step", "sampled tokens", "held-out goal at step 0", "final held-out goal",
            "wall seconds", "warnings"]
    rows = []
    for r in runs:
        last = r.train[-1] if r.train else {}
        rows.append([_e(str(r.run_dir)), _e("finished" if r.finished else "not finished"), _e(str(r.last_step)),
                     _e(last.get("train/sampled_tokens", "")), _e(step0_goal(r)) if step0_goal(r) is not None else "",
                     _e(_final_goal(r)) if _final_goal(r) is not None else "",
                     _e((r.summary or {}).get("wall_seconds", "")), _e(len(r.run_warnings))])
    parts = [f"<h1>{_e(title)}</h1>", _table(head, rows, "num")]
    for r in runs:
        if r.warnings:
            parts.append('<ul class="warn">' + "".join(f"<li>{_e(r.name)}: {_e(w)}</li>" for w in r.warnings) + "</ul>")
    diffs = config_differences(runs)
    parts.append("<h2>Config keys that differ</h2>")
    parts.append(_table(["key", *(r.name for r in runs)], [[_e(k), *(_e(json.dumps(v)) for v in vals)]
                                                             for k, vals in diffs])
                 if diffs else "<p>None: the runs share one config.</p>")
    parts.append(_plots_section(pngs, plan_plots(runs)[1]))
    parts.append(_run_warnings_section(runs))
    body = "\n".join(parts)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{CSS}</style></head>\n<body>\n{body}\n</body></html>\n")


# --------------------------------------------------------------------------- command


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


def command(args) -> int:
    """`rlvr report`: validate everything, then write the PNGs and report.html; print their paths."""
    run_dirs = args.run_dir if isinstance(args.run_dir, list) else [args.run_dir]
    try:
        runs = [load_run_records(d) for d in run_dirs]
        out = Path(args.out) if getattr(args, "out", None) else default_out(run_dirs)
        _check_out_dir(out)
        _import_matplotlib()  # before anything is created
        make_out_dir(out)
        pngs = plot(runs, out)
        page = render_html(runs[0], pngs) if len(runs) == 1 else render_compare_html(runs, pngs)
        html_path = write_replacing(out, HTML_NAME, lambda f: f.write(page.encode("utf-8")))
    except ReportError as e:
        print(f"rlvr: error: {e}", file=sys.stderr)
        return 2
    for r in runs:
        for w in r.warnings:
            print(f"rlvr: warning: {w}", file=sys.stderr)
    for p in [*pngs, html_path]:
        print(p)
    return 0
