"""The report's self-contained HTML page: one run (`render_html`) or several compared
(`render_compare_html`); every PNG inline as a data: URI, every string from a run escaped."""

from __future__ import annotations

import base64
import html
import json
import time
from pathlib import Path

from rlvr.report.plots import _x_axis, _x_of, plan_plots
from rlvr.report.records import RunRecords, _fmt, _num

ROLLOUT_STEPS = 3        # latest steps whose groups are shown
ROLLOUT_GROUPS = 12      # at most this many groups in the table
RESPONSE_CHARS = 400     # longer responses are cut in the table (the rest is model output nobody reads)


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
    decode step, its `wall_seconds_expected` (which prices the steps without their rewards) is set
    against the counted `step_seconds` less `score_seconds` (the row `unscored_step_seconds`; ratio
    `cost/steps_vs_expected`); a run that predates `score_seconds` has it against its `step_seconds`
    (the row `step_seconds`), and one that predates `step_seconds` against its whole wall time (the row
    `wall_seconds_expected`, ratio `cost/wall_vs_expected`). Before cost/* keys existed,
    summary.json carried the counted sampled tokens as `sampled_tokens`; that is used for
    `sampled_tokens` when `cost/sampled_tokens` is absent."""
    price = records.price or {}
    summary = records.summary or {}
    priced = {k[: -len("_per_run")]: v for k, v in price.items() if k.endswith("_per_run")}
    counted = {k[len("cost/"):]: v for k, v in summary.items() if k.startswith("cost/") and k not in RATIOS}
    if _num(counted.get("step_seconds")) and _num(counted.get("score_seconds")):
        counted["unscored_step_seconds"] = counted["step_seconds"] - counted["score_seconds"]
    expected_as = next((k for k in ("unscored_step_seconds", "step_seconds") if k in counted), "wall_seconds_expected")
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
