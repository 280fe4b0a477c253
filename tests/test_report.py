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
           "train/nonzero_delta_frac": 0.5, "train/agreeing_groups_frac": 0.25, "train/entropy": 2.0 - 0.1 * step,
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
                                                  "sampled_tokens_per_grad_step": 48.0, "flops_per_run": 123456789}))
    if finished:
        (d / "summary.json").write_text(json.dumps({"eval/goal": 0.8, "eval/reward": 0.84, "steps": steps,
                                                    "sampled_tokens": 180, "cost/sampled_tokens": 180,
                                                    "cost/flops": 98765432, "cost/trained_tokens": 77}))
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
    assert {p.name for p in pngs} == {"reward.png", "nonzero_delta.png", "kl.png", "entropy.png", "response_len.png"}
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
    # the run's own files are untouched
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint", "config.toml", "metrics.jsonl", "price.json",
                                                      "report", "rollouts.jsonl", "summary.json"]


def test_price_against_counted_table(tmp_path):
    rec = report.load_run_records(make_run(tmp_path / "run"))
    rows = {name: (p, c) for name, p, c in report.cost_rows(rec)}
    assert rows["sampled_tokens"] == (192, 180)
    assert rows["flops"] == (123456789, 98765432)
    assert rows["trained_tokens"] == (None, 77)             # counted without a price still gets a row
    page = report.render_html(rec, [])
    section = page.split("Price against counted cost")[1].split("<h2>")[0]
    for figure in ("192", "180", "123,456,789", "98,765,432", "0.9375"):
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
    label, by_step = report._x_axis(rec)
    assert label == "sampled tokens"
    assert report._series(rec.eval, "eval/goal", by_step, label) == ([96, 192], [0.4, 0.8])


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
    assert page.count("data:image/png;base64,") >= 4
    assert "final (summary.json)" in page and "sampled_tokens" in page
    for p in out.split():
        if p.endswith(".png"):
            assert Path(p).read_bytes()[:8] == PNG_SIGNATURE


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
