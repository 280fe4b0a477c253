"""The report's PNG plots: what each shows (`plan_plots`), drawing them with matplotlib's Agg canvas
(`plot`), and reading back the data a PNG carries (`read_png_series`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlvr.report.outputs import EVAL_SERIES, PLOTS, make_out_dir, write_replacing
from rlvr.report.records import ReportError, RunRecords, _fmt, _num

INSTALL_HINT = 'pip install "rlvr[report]"'


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
