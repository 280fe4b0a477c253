"""`rlvr report RUN_DIR [--out DIR]`: PNG plots and one self-contained HTML page for a run.

Works on a finished run, one still going, or one that was cut off: the last line of a JSONL file
may be half-written (it is ignored, with a warning), summary.json / price.json / checkpoint/ may be
absent. A corrupt line anywhere but the last is an error naming file:line.

    records = load_run_records(run_dir)       # RunRecords; ReportError on bad input
    pngs = plot(records, out_dir)             # list[Path] (matplotlib, Agg canvas, imported here)
    html = render_html(records, pngs)         # str: PNGs embedded as data: URIs, no external assets
    command(args) -> int                      # the CLI entry point; prints the paths it wrote

Files written (and the only ones ever overwritten): report.html and the PNG names in PLOTS.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

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
    warnings: list[str] = field(default_factory=list)
    price_source: str | None = None

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


def _read_jsonl(path: Path, warnings: list[str]) -> list[dict]:
    """Rows of a JSONL file. An unparseable last line is dropped (half-written); any other is an error."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
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
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
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
    if not metrics.is_file():
        what = "is empty" if not any(run_dir.iterdir()) else "has no metrics.jsonl"
        raise ReportError(f"{run_dir} {what}; expected a run directory written by `rlvr train`")
    rec = RunRecords(run_dir=run_dir)
    for row in _read_jsonl(metrics, rec.warnings):
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
    if rollouts.is_file():
        rec.rollouts = [r for r in _read_jsonl(rollouts, rec.warnings) if isinstance(r.get("responses"), list)]
    cfg = run_dir / "config.toml"
    if cfg.is_file():
        try:
            rec.config_text = cfg.read_text(encoding="utf-8", errors="replace")
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


def plot(records: RunRecords, out_dir) -> list[Path]:
    """Write one PNG per plot that has data into out_dir (created if needed); return their paths.

    Uses matplotlib's Agg canvas directly (no pyplot, no global backend switch)."""
    Figure, FigureCanvasAgg = _import_matplotlib()
    out_dir = Path(out_dir)
    label, by_step = _x_axis(records)
    written = []
    for name, title, ylabel, keys in PLOTS:
        series = [(lab, *_series(records.train, k, by_step, label), "-") for k, lab in keys]
        if name == "reward.png":
            series += [(lab, *_series(records.eval, k, by_step, label), "o--") for k, lab in EVAL_SERIES]
        series = [s for s in series if s[1]]
        if not series:
            continue
        fig = Figure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for lab, xs, ys, style in series:
            ax.plot(xs, ys, style, label=lab, markersize=4, linewidth=1.4)
        ax.set_title(title)
        ax.set_xlabel(label)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
        fig.subplots_adjust(left=0.11, right=0.97, bottom=0.13, top=0.91)  # fixed: tight_layout draws twice
        path = out_dir / name
        _check_writable(path)
        fig.savefig(path, format="png")
        written.append(path)
    return written


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


def cost_rows(records: RunRecords) -> list[tuple[str, object, object]]:
    """(figure X, price of X_per_run or None, counted cost/X or None), matched by name.

    A counted figure without a price, and a price without a count, each get a row. Before cost/*
    keys existed, summary.json carried the counted sampled tokens as `sampled_tokens`; that is
    used for `sampled_tokens` when `cost/sampled_tokens` is absent."""
    price = records.price or {}
    summary = records.summary or {}
    priced = {k[: -len("_per_run")]: v for k, v in price.items() if k.endswith("_per_run")}
    counted = {k[len("cost/"):]: v for k, v in summary.items() if k.startswith("cost/")}
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
    facts.append(("checkpoint", "present" if (records.run_dir / "checkpoint").is_dir() else "absent"))
    facts.append(("generated", time.strftime("%Y-%m-%d %H:%M:%S")))
    parts = [f"<h1>{_e(title)}</h1>", _table(None, [[_e(k), _e(v)] for k, v in facts])]
    if records.warnings:
        parts.append('<ul class="warn">' + "".join(f"<li>{_e(w)}</li>" for w in records.warnings) + "</ul>")
    parts.append('<h2>Plots</h2><div class="plots">')
    if not pngs:
        parts.append("<p>No plots.</p>")
    for p in pngs:
        p = Path(p)
        data = base64.b64encode(p.read_bytes()).decode("ascii")
        parts.append(f'<img alt="{_e(p.stem)}" src="data:image/png;base64,{data}">')
    parts.append("</div>")
    parts.append(_eval_section(records))
    parts.append(_cost_section(records))
    parts.append(_rollout_section(records))
    parts.append("<h2>Config</h2>")
    parts.append(f"<pre>{_e(records.config_text)}</pre>" if records.config_text is not None
                 else "<p>No config.toml.</p>")
    body = "\n".join(parts)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{CSS}</style></head>\n<body>\n{body}\n</body></html>\n")


# --------------------------------------------------------------------------- command


def _check_writable(path: Path) -> None:
    """Only regular files of our own names are replaced; never follow a link or replace a directory."""
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise ReportError(f"{path} exists and is not a regular file; refusing to overwrite it")


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out} is a file, not a directory; choose another path")
    for name in OUTPUT_NAMES:
        _check_writable(out / name)


def command(args) -> int:
    """`rlvr report`: validate everything, then write the PNGs and report.html; print their paths."""
    try:
        records = load_run_records(args.run_dir)
        out = Path(args.out) if getattr(args, "out", None) else Path(args.run_dir) / "report"
        _check_out_dir(out)
        _import_matplotlib()  # before anything is created
        out.mkdir(parents=True, exist_ok=True)
        pngs = plot(records, out)
        page = render_html(records, pngs)
        html_path = out / HTML_NAME
        tmp = out / f".{HTML_NAME}.tmp"
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, html_path)
    except ReportError as e:
        print(f"rlvr: error: {e}", file=sys.stderr)
        return 2
    for w in records.warnings:
        print(f"rlvr: warning: {w}", file=sys.stderr)
    for p in [*pngs, html_path]:
        print(p)
    return 0
