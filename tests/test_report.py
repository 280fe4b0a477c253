"""`rlvr report`: plots and one self-contained HTML page for a finished, running or cut-off run.

Run directories are written by hand (no training) except one test that trains two tiny steps and
reports the real thing. Bad input must be `rlvr: error: ...`, exit 2, and nothing created.
"""

from __future__ import annotations

import io
import json
import re
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from rlvr import report
from rlvr.report import plots as report_plots
from rlvr.cli import main

pytest.importorskip("matplotlib")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sort.toml"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EVIL = "<script>alert(1)</script>"


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def train_row(step: int, *, kl_ref: bool = False) -> dict:
    row = {"step": step, "train/reward": 0.1 * step, "train/goal": 0.05 * step, "train/sampled_tokens": 48 * step,
           "train/nonzero_delta_frac": 0.5 + 0.01 * step, "train/agreeing_groups_frac": 0.25, "train/entropy": 2.0 - 0.1 * step,
           "train/approx_kl_old": 1e-3 * step, "train/response_len": 3.0, "train/clip_frac": 0.0}
    if kl_ref:
        row["train/kl_ref"] = 2e-3 * step
    return row


def make_run(d: Path, *, steps: int = 4, finished: bool = True, price: bool = True, half_line: bool = False,
             responses=("123", "132", EVIL, "321")) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.toml").write_text('[task]\npath = "rlvr.tasks.sort:sort_task"\noptions = { n = 3 }\n# a < b & c\n')
    lines = []
    for s in range(1, steps + 1):
        lines.append(json.dumps(train_row(s, kl_ref=True)))
        if s % 2 == 0:
            lines.append(json.dumps({"step": s, "eval/goal": 0.2 * s, "eval/reward": 0.21 * s, "eval/prompts": 20,
                                     "eval/pass@4": 0.3}))
    text = "\n".join(lines) + "\n"
    if half_line:
        text += '{"step": 99, "train/rew'
    (d / "metrics.jsonl").write_text(text)
    with open(d / "rollouts.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "prompt": "312=", "answer": "123", "responses": list(responses),
                                "rewards": [1.0, 0.33, 0.0, 0.0], "delta": [1.2, 0.1, -0.65, -0.65]}) + "\n")
    if price:
        (d / "price.json").write_text(json.dumps({"steps": steps, "sampled_tokens_per_run": 192,
                                                  "sampled_tokens_per_grad_step": 48.0, "flops_per_run": 123456789,
                                                  "wall_seconds_estimate": 40.0}))
    if finished:
        (d / "summary.json").write_text(json.dumps({"eval/goal": 0.8, "eval/reward": 0.84, "steps": steps,
                                                    "sampled_tokens": 180, "cost/sampled_tokens": 180,
                                                    "cost/flops": 98765432, "cost/trained_tokens": 77,
                                                    "cost/wall_seconds": 50.0, "cost/wall_vs_estimate": 1.25}))
        (d / "checkpoint").mkdir()
    return d


def html_of(out: Path) -> str:
    return (out / "report.html").read_text(encoding="utf-8")


# --------------------------------------------------------------------------- good runs


def test_finished_run_writes_pngs_and_self_contained_html(tmp_path):
    run = make_run(tmp_path / "run")
    rc, out, err = cli("report", run)
    assert rc == 0, err
    rep = run / "report"
    written = [Path(p) for p in out.split()]
    assert rep / "report.html" in written
    pngs = [p for p in written if p.suffix == ".png"]
    # response length is 3.0 at every step (a fixed-length task): no response_len.png, a note instead
    assert {p.name for p in pngs} == {"reward.png", "nonzero_delta.png", "kl.png", "entropy.png"}
    for p in pngs:
        assert p.read_bytes()[:8] == PNG_SIGNATURE
    page = html_of(rep)
    assert page.count("data:image/png;base64,") == len(pngs)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", page)
    assert "<link" not in page and "<script" not in page.lower().replace("&lt;script", "")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and EVIL not in page
    assert "a &lt; b &amp; c" in page                      # config in a pre block, escaped
    assert "<pre>" in page and "sort_task" in page
    assert "final (summary.json)" in page and "run not finished" not in page
    assert "312=" in page                                   # rollouts table
    assert "mean response length: not plotted: constant at 3 over 4 steps" in page
    # agreeing groups are flat (0.25) and dropped from their plot, the non-zero Δ fraction is kept
    nz = report.read_png_series(rep / "nonzero_delta.png")
    assert [ln["label"] for ln in nz["panels"][0]["lines"]] == ["non-zero Δ fraction"]
    # the run's own files are untouched
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint", "config.toml", "metrics.jsonl", "price.json",
                                                      "report", "rollouts.jsonl", "summary.json"]


def test_the_expected_wall_time_is_a_row_against_the_same_wall_time(tmp_path):
    d = make_run(tmp_path / "run")
    price = json.loads((d / "price.json").read_text())
    (d / "price.json").write_text(json.dumps({**price, "wall_seconds_expected": 45.0, "decode_step_s": 0.01}))
    summary = json.loads((d / "summary.json").read_text())
    (d / "summary.json").write_text(json.dumps({**summary, "cost/wall_vs_expected": 50.0 / 45.0}))
    rows = {name: (p, c) for name, p, c in report.cost_rows(report.load_run_records(d))}
    assert rows["wall_seconds"] == (40.0, 50.0) and rows["wall_seconds_expected"] == (45.0, 50.0)
    assert "wall_vs_expected" not in rows and "wall_vs_estimate" not in rows


def test_price_against_counted_table(tmp_path):
    rec = report.load_run_records(make_run(tmp_path / "run"))
    rows = {name: (p, c) for name, p, c in report.cost_rows(rec)}
    assert rows["sampled_tokens"] == (192, 180)
    assert rows["flops"] == (123456789, 98765432)
    assert rows["trained_tokens"] == (None, 77)             # counted without a price still gets a row
    assert rows["wall_seconds"] == (40.0, 50.0)             # the wall-time estimate against the real wall time
    assert "wall_vs_estimate" not in rows                   # that ratio is the row's counted / price
    page = report.render_html(rec, [])
    section = page.split("Price against counted cost")[1].split("<h2>")[0]
    for figure in ("192", "180", "123,456,789", "98,765,432", "0.9375", "1.25"):
        assert figure in section
    assert "sampled_tokens_per_grad_step" in section        # the other price fields


def test_running_run_half_written_last_line_no_summary(tmp_path):
    run = make_run(tmp_path / "run", finished=False, half_line=True)
    rec = report.load_run_records(run)
    assert [r["step"] for r in rec.train] == [1, 2, 3, 4]   # the half-written step 99 is dropped
    assert [r["step"] for r in rec.eval] == [2, 4]
    assert rec.summary is None and any("metrics.jsonl:7" in w for w in rec.warnings)
    out = tmp_path / "rep"
    rc, _, err = cli("report", run, "--out", out)
    assert rc == 0, err
    assert "warning" in err and "metrics.jsonl:7" in err
    page = html_of(out)
    section = page.split("Price against counted cost")[1].split("<h2>")[0]
    assert "run not finished" in section and "192" in section
    assert "latest (step 4; run not finished)" in page
    assert "checkpoint</td><td>absent" in page
    assert not (run / "report").exists()                    # --out honoured


def test_eval_rows_placed_at_sampled_tokens_of_their_step(tmp_path):
    rec = report.load_run_records(make_run(tmp_path / "run"))
    label, by_step = report_plots._x_axis(rec)
    assert label == "sampled tokens"
    assert report_plots._series(rec.eval, "eval/goal", by_step, label) == ([96, 192], [0.4, 0.8])


def test_no_price_no_kl_ref_and_legacy_summary(tmp_path):
    run = make_run(tmp_path / "run", price=False)
    summary = json.loads((run / "summary.json").read_text())
    summary = {k: v for k, v in summary.items() if not k.startswith("cost/")}
    summary["price"] = {"sampled_tokens_per_run": 192}      # today's trainer keeps the price in summary.json
    (run / "summary.json").write_text(json.dumps(summary))
    rec = report.load_run_records(run)
    assert rec.price_source == "summary.json (price)"
    assert report.cost_rows(rec) == [("sampled_tokens", 192, 180)]
    (run / "summary.json").unlink()
    rec = report.load_run_records(run)
    assert rec.price is None and report.cost_rows(rec) == []
    assert "No price recorded" in report.render_html(rec, [])


# --------------------------------------------------------------------------- bad input


def test_corrupt_middle_line_names_file_and_line(tmp_path):
    run = make_run(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[2] = lines[2][:20]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rc, out, err = cli("report", run)
    assert rc == 2 and out == ""
    assert err.startswith("rlvr: error: ") and f"{run / 'metrics.jsonl'}:3" in err
    assert not (run / "report").exists()


@pytest.mark.parametrize("case", ["missing", "empty", "no_metrics", "empty_metrics", "only_half_line", "file"])
def test_bad_run_dir_is_an_error_and_writes_nothing(tmp_path, case):
    run = tmp_path / "run"
    if case != "missing" and case != "file":
        run.mkdir()
    if case == "no_metrics":
        (run / "config.toml").write_text("")
    if case == "empty_metrics":
        (run / "metrics.jsonl").write_text("")
    if case == "only_half_line":
        (run / "metrics.jsonl").write_text('{"step": 1, "tra')
    if case == "file":
        run.write_text("not a run")
    before = sorted(tmp_path.rglob("*"))
    out = tmp_path / "out"
    rc, stdout, err = cli("report", run, "--out", out)
    assert rc == 2 and stdout == ""
    assert err.startswith("rlvr: error: ") and str(run) in err
    assert sorted(tmp_path.rglob("*")) == before            # neither --out nor RUN_DIR/report created


def test_out_is_a_file_is_an_error(tmp_path):
    run = make_run(tmp_path / "run")
    (tmp_path / "taken").write_text("keep me")
    rc, _, err = cli("report", run, "--out", tmp_path / "taken")
    assert rc == 2 and "is a file" in err
    assert (tmp_path / "taken").read_text() == "keep me"


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    run = make_run(tmp_path / "run")
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)    # `import matplotlib...` now raises ImportError
    rc, _, err = cli("report", run)
    assert rc == 2 and 'pip install "rlvr[report]"' in err
    assert not (run / "report").exists()


# --------------------------------------------------------------------------- a real run


def test_report_on_a_real_tiny_run(tmp_path):
    d = tmp_path / "real"
    rc, _, err = cli("train", EXAMPLE, "--out", d, "--train.steps=2", "--model.n_embd=32", "--model.n_layer=1",
                     "--model.n_head=2", "--train.prompts_per_step=4", "--train.samples_per_prompt=4",
                     "--task.options={n = 3, heldout = 50}", "--eval.prompts=20", "--eval.pass_k=0")
    assert rc == 0, err
    rc, out, err = cli("report", d)
    assert rc == 0, err
    rec = report.load_run_records(d)
    assert [r["step"] for r in rec.train] == [1, 2] and rec.finished and rec.warnings == []
    page = html_of(d / "report")
    pngs = [Path(p) for p in out.split() if p.endswith(".png")]
    assert page.count("data:image/png;base64,") == len(pngs) >= 2
    # one update per batch: KL to π_old is 0 by construction and is not plotted, whatever its float noise
    assert "approx KL to π_old: not plotted: one update per batch" in page
    assert not (d / "report" / "kl.png").exists()           # no KL to a reference in this run either
    # the sort task has a fixed response length: no response-length plot
    assert not (d / "report" / "response_len.png").exists() and "mean response length: not plotted" in page
    assert "final (summary.json)" in page and "sampled_tokens" in page
    for p in out.split():
        if p.endswith(".png"):
            assert Path(p).read_bytes()[:8] == PNG_SIGNATURE


# --------------------------------------------------------------------------- what the PNGs show


def lines_of(png: Path, panel: int = 0) -> dict:
    """{label: (x, y)} of one panel, read back from the PNG file itself."""
    data = report.read_png_series(png)
    return {ln["label"]: (ln["x"], ln["y"]) for ln in data["panels"][panel]["lines"]}


def test_pngs_show_each_series_against_steps_and_sampled_tokens(tmp_path):
    from PIL import Image

    run = make_run(tmp_path / "run")
    rc, _, err = cli("report", run)
    assert rc == 0, err
    png = run / "report" / "reward.png"
    data = report.read_png_series(png)
    assert [(p["x"], p["xlabel"]) for p in data["panels"]] == [("step", "step"), ("sampled tokens", "sampled tokens")]
    by_step, by_tokens = lines_of(png, 0), lines_of(png, 1)
    assert set(by_step) == {"train reward", "train goal", "held-out goal", "held-out reward"}
    assert by_step["train reward"] == ([1, 2, 3, 4], pytest.approx([0.1, 0.2, 0.3, 0.4]))
    assert by_tokens["train reward"] == ([48, 96, 144, 192], pytest.approx([0.1, 0.2, 0.3, 0.4]))
    assert by_step["held-out goal"] == ([2, 4], pytest.approx([0.4, 0.8]))
    assert by_tokens["held-out goal"] == ([96, 192], pytest.approx([0.4, 0.8]))
    assert lines_of(run / "report" / "entropy.png", 0)["entropy"][1] == pytest.approx([1.9, 1.8, 1.7, 1.6])
    with Image.open(png) as img:  # a real two-panel picture, not a blank canvas
        assert img.size == (1120, 400)
        assert len(img.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 20


def test_a_run_with_tool_calls_gets_their_plot(tmp_path):
    run = make_run(tmp_path / "run")
    rows = [dict(train_row(s), **{"train/tool_calls_per_response": 0.25 * s}) for s in range(1, 5)]
    write_metrics(run, rows)
    rc, out, err = cli("report", run)
    assert rc == 0, err
    png = run / "report" / "tool_calls.png"
    assert lines_of(png, 0)["tool calls per response"] == ([1, 2, 3, 4], pytest.approx([0.25, 0.5, 0.75, 1.0]))
    plain = make_run(tmp_path / "plain")                     # a run without tools: no such plot, no note
    assert cli("report", plain)[0] == 0
    assert not (plain / "report" / "tool_calls.png").exists() and "tool calls" not in html_of(plain / "report")


def write_metrics(run: Path, rows: list[dict]) -> None:
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_kl_to_pi_old_zero_by_construction_is_said_not_plotted(tmp_path):
    run = make_run(tmp_path / "run")
    (run / "config.toml").write_text("[train]\nepochs_per_batch = 1\nminibatches = 1\n")
    rows = [{**train_row(s, kl_ref=True), "train/approx_kl_old": 1e-14 * s} for s in range(1, 5)]
    write_metrics(run, rows)
    rec = report.load_run_records(run)
    specs, notes = report.plan_plots([rec])
    kl = next(sp for sp in specs if sp.name == "kl.png")
    assert [se.key for se in kl.series] == ["train/kl_ref"]      # only the KL to the reference
    assert any("approx KL to π_old: not plotted: one update per batch" in n for n in notes)
    # two updates per batch: the KL to π_old is real and plotted
    (run / "config.toml").write_text("[train]\nepochs_per_batch = 2\nminibatches = 1\n")
    kl = next(sp for sp in report.plan_plots([report.load_run_records(run)])[0] if sp.name == "kl.png")
    assert [se.key for se in kl.series] == ["train/approx_kl_old", "train/kl_ref"]
    # no config: read from the data (every value below 1e-9)
    (run / "config.toml").unlink()
    assert "below 1e-9" in report.kl_old_zero_reason(report.load_run_records(run))


def test_run_warnings_and_step0_eval_are_in_the_report(tmp_path):
    run = make_run(tmp_path / "run")
    rows = [{"step": 0, "eval/goal": 0.006, "eval/reward": 0.05}]
    for s in range(1, 5):
        rows.append(train_row(s))
    rows.append({"step": 3, "warning": "95% of groups agree over the last 10 steps and teach nothing; <b>x</b>"})
    rows.append({"step": 4, "eval/goal": 0.5, "eval/reward": 0.6})
    write_metrics(run, rows)
    rec = report.load_run_records(run)
    assert rec.run_warnings == [(3, rows[5]["warning"])]
    rc, _, err = cli("report", run)
    assert rc == 0, err
    page = html_of(run / "report")
    section = page.split("Warnings the run printed")[1].split("<h2>")[0]
    assert "<td>3</td>" in section and "teach nothing; &lt;b&gt;x&lt;/b&gt;" in section
    assert "held-out goal at step 0 (before training)</td><td>0.006" in page
    goal = lines_of(run / "report" / "reward.png", 0)["held-out goal"]
    assert goal == ([0, 4], pytest.approx([0.006, 0.5]))
    assert lines_of(run / "report" / "reward.png", 1)["held-out goal"][0] == [0, 192]  # 0 tokens before training
    every = page.split("every evaluation")[1].split("</details>")[0]
    assert "<td>0</td>" in every


def test_two_runs_are_overlaid_and_compared(tmp_path):
    a = make_run(tmp_path / "runA")
    b = make_run(tmp_path / "runB")
    (b / "config.toml").write_text('[task]\npath = "rlvr.tasks.sort:sort_task"\noptions = { n = 4 }\n')
    write_metrics(b, [{**train_row(s), "train/reward": 0.05 * s} for s in range(1, 7)]
                  + [{"step": 6, "warning": "entropy fell"}])
    out = tmp_path / "cmp"
    rc, stdout, err = cli("report", a, b, "--out", out)
    assert rc == 0, err
    by_step = lines_of(out / "reward.png", 0)
    assert by_step["runA: train reward"] == ([1, 2, 3, 4], pytest.approx([0.1, 0.2, 0.3, 0.4]))
    assert by_step["runB: train reward"] == ([1, 2, 3, 4, 5, 6], pytest.approx([0.05 * s for s in range(1, 7)]))
    assert "runA: held-out goal" in by_step and "runB: held-out goal" not in by_step  # B has no evaluation rows
    page = html_of(out)
    assert "rlvr report: runA vs runB" in page and page.count("data:image/png;base64,") == len(stdout.split()) - 1
    diff = page.split("Config keys that differ")[1].split("<h2>")[0]
    assert "task.options" in diff and "{&quot;n&quot;: 3}" in diff and "{&quot;n&quot;: 4}" in diff
    assert "<td>runB</td><td>6</td><td>entropy fell</td>" in page
    # without --out the comparison goes beside the first run
    rc, stdout, err = cli("report", a, b)
    assert rc == 0, err
    assert Path(stdout.split()[-1]) == tmp_path / "compare-runA-vs-runB" / "report.html"


def test_report_html_screenshot_in_headless_chromium(tmp_path):
    """A real browser renders report.html: the page loads and its plots have their drawn size."""
    import shutil
    import subprocess

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on this machine (apt-get install -y chromium): the screenshot check needs a browser")
    run = make_run(tmp_path / "run")
    rc, _, err = cli("report", run)
    assert rc == 0, err
    shot = tmp_path / "report.png"
    res = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--screenshot={shot}", "--window-size=1200,2400",
                          (run / "report" / "report.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.is_file(), res.stderr[-2000:]
    from PIL import Image

    with Image.open(shot) as img:
        assert img.size == (1200, 2400)
        rgb = img.convert("RGB")
        # the plots are drawn: matplotlib's default blue (C0, #1f77b4) appears in the page
        assert any(abs(r - 0x1F) < 24 and abs(g - 0x77) < 24 and abs(b - 0xB4) < 24
                   for _, (r, g, b) in rgb.getcolors(maxcolors=1 << 20))


def test_an_interrupted_run_is_not_reported_as_finished(tmp_path):
    run = make_run(tmp_path / "run", finished=False)
    (run / "summary.json").write_text(json.dumps({"interrupted": True, "signal": "SIGINT", "exit_code": 130,
                                                  "steps": 4, "sampled_tokens": 192}))
    rec = report.load_run_records(run)
    assert rec.summary is not None and not rec.finished
    out = tmp_path / "rep"
    rc, _, err = cli("report", run, "--out", out)
    assert rc == 0, err
    page = html_of(out)
    assert "interrupted (Ctrl-C or SIGTERM; continue it with rlvr train --resume)" in page
    assert "run not finished: it was interrupted" in page
