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

import sys
from pathlib import Path

from rlvr.report.outputs import (HTML_NAME, OUTPUT_NAMES, PLOTS, _check_out_dir, default_out, make_out_dir,
                                 write_replacing)
from rlvr.report.page import cost_rows, render_compare_html, render_html
from rlvr.report.plots import _import_matplotlib, kl_old_zero_reason, plan_plots, plot, read_png_series
from rlvr.report.records import ReportError, RunRecords, is_own_file, load_run_records, read_own_text

__all__ = ["HTML_NAME", "OUTPUT_NAMES", "PLOTS", "ReportError", "RunRecords", "command", "cost_rows", "default_out",
           "is_own_file", "kl_old_zero_reason", "load_run_records", "make_out_dir", "plan_plots", "plot",
           "read_own_text", "read_png_series", "render_compare_html", "render_html", "write_replacing"]


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
