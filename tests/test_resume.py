"""Resume: an interrupted run continues as if it had not stopped; nothing is lost or duplicated."""

import json

import pytest
from safetensors.torch import load_file

from rlvr import cli

TINY = ["--model.n_embd=32", "--model.n_layer=1", "--model.n_head=2", "--train.prompts_per_step=4",
        "--train.samples_per_prompt=4", "--task.options={n = 3, heldout = 50}", "--eval.prompts=20",
        "--eval.pass_k=0", "--eval.every=0", "--train.lr=0.01", "--train.lr_schedule=constant"]


def train_rows(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows if "train/reward" in r]


def test_resumed_run_equals_the_uninterrupted_one(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert cli.main(["train", "examples/sort.toml", "--out", str(straight), *TINY, "--train.steps=4"]) == 0
    assert cli.main(["train", "examples/sort.toml", "--out", str(split), *TINY, "--train.steps=2"]) == 0
    assert (split / "state" / "state.json").is_file()
    assert cli.main(["train", "examples/sort.toml", "--out", str(split), *TINY, "--train.steps=4", "--resume"]) == 0
    assert train_rows(split) == train_rows(straight)
    assert [r["step"] for r in train_rows(split)] == [1, 2, 3, 4]
    a = load_file(str(straight / "checkpoint" / "model.safetensors"))
    b = load_file(str(split / "checkpoint" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (straight, split))
    assert sa["eval/goal"] == sb["eval/goal"] and sa["cost/sampled_tokens"] == sb["cost/sampled_tokens"]
    # the steps' seconds carry over the resume: both sessions' steps, each counted once
    rows = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    assert sb["cost/step_seconds"] == pytest.approx(sum(r["time/step_s"] for r in rows if "time/step_s" in r),
                                                   rel=1e-9)
    assert 0 < sb["cost/step_seconds"] + sb["cost/eval_seconds"] <= sb["wall_seconds"]
    rollout_steps = [json.loads(line)["step"] for line in (split / "rollouts.jsonl").read_text().splitlines()]
    assert rollout_steps == sorted(rollout_steps) and rollout_steps.count(3) == 2   # no duplicates


def test_rows_written_after_the_last_state_are_dropped(tmp_path):
    run = tmp_path / "run"
    assert cli.main(["train", "examples/sort.toml", "--out", str(run), *TINY, "--train.steps=2"]) == 0
    with open(run / "metrics.jsonl", "a") as f:       # what a run killed after step 2's state might leave
        f.write(json.dumps({"step": 3, "train/reward": 0.5}) + "\n" + '{"step": 4, "train/rew')
    assert cli.main(["train", "examples/sort.toml", "--out", str(run), *TINY, "--train.steps=3", "--resume"]) == 0
    steps = [r["step"] for r in train_rows(run)]
    assert steps == [1, 2, 3]


def test_resume_refuses_a_changed_config_and_a_run_without_state(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(["train", "examples/sort.toml", "--out", str(run), *TINY, "--train.steps=1"]) == 0
    before = (run / "metrics.jsonl").read_bytes()
    rc = cli.main(["train", "examples/sort.toml", "--out", str(run), *TINY, "--train.steps=2", "--train.lr=0.02",
                   "--resume"])
    assert rc == 2 and "train.lr" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_bytes() == before
    rc = cli.main(["train", "examples/sort.toml", "--out", str(tmp_path / "nothing"), *TINY, "--resume"])
    assert rc == 2 and "no resumable state" in capsys.readouterr().err
    rc = cli.main(["train", "examples/sort.toml", *TINY, "--resume"])
    assert rc == 2 and "--out" in capsys.readouterr().err


def test_a_resume_may_skip_the_price_probes_and_the_memory_check(tmp_path, capsys):
    """train.price_probes and train.memory_check change no update: a resume may turn them off (the
    start measured the machine already) and goes on from the saved step; a key that changes the
    update is still refused (above)."""
    run = tmp_path / "run"
    assert cli.main(["train", "examples/sort.toml", "--out", str(run), *TINY, "--train.steps=1"]) == 0
    capsys.readouterr()
    assert cli.main(["train", "examples/sort.toml", "--out", str(run), *TINY, "--train.steps=2",
                     "--train.price_probes=false", "--train.memory_check=false", "--resume"]) == 0
    assert "differs" not in capsys.readouterr().err
    assert [r["step"] for r in train_rows(run)] == [1, 2]


def test_a_longer_resume_under_a_decaying_schedule_says_what_the_rate_does(tmp_path, capsys):
    # cosine over 2 steps, resumed after step 2 for 4: the saved schedule has ended (frac 1: 0.1 x lr);
    # over 4 steps, optimizer step 2 of 4 is half way: 0.1 + 0.9 * (1 + cos(pi / 2)) / 2 = 0.55 x lr
    run = tmp_path / "run"
    cosine = [*TINY, "--train.lr_schedule=cosine"]
    assert cli.main(["train", "examples/sort.toml", "--out", str(run), *cosine, "--train.steps=2"]) == 0
    capsys.readouterr()
    assert cli.main(["train", "examples/sort.toml", "--out", str(run), *cosine, "--train.steps=4", "--resume"]) == 0
    out = capsys.readouterr().out
    assert ("note: train.steps changed from 2 to 4 under lr_schedule = 'cosine': the learning rate is laid out "
            "over 4 steps from step 3 on, at 0.55 x train.lr there (the saved run's schedule: 0.1 x)") in out
    assert [r["step"] for r in train_rows(run)] == [1, 2, 3, 4]
    # the same length again, or a constant schedule: nothing to say
    assert cli.main(["train", "examples/sort.toml", "--out", str(run), *cosine, "--train.steps=4", "--resume"]) == 0
    const = tmp_path / "const"
    assert cli.main(["train", "examples/sort.toml", "--out", str(const), *TINY, "--train.steps=1"]) == 0
    assert cli.main(["train", "examples/sort.toml", "--out", str(const), *TINY, "--train.steps=2", "--resume"]) == 0
    assert "train.steps changed" not in capsys.readouterr().out


def test_a_state_saved_before_the_seconds_were_counted_resumes_counting_from_zero(tmp_path):
    """A state.json whose cost has no step_seconds / eval_seconds (written before they were counted)
    resumes; the summary then counts the resumed session's steps only."""
    run = tmp_path / "run"
    assert cli.main(["train", "examples/sort.toml", "--out", str(run), *TINY, "--train.steps=2"]) == 0
    meta_file = run / "state" / "state.json"
    text = meta_file.read_text()
    meta = json.loads(text)
    assert meta["cost"]["step_seconds"] > 0 and "eval_seconds" in meta["cost"]
    del meta["cost"]["step_seconds"], meta["cost"]["eval_seconds"]
    old = json.dumps(meta)
    meta_file.write_text(old + " " * (len(text) - len(old)))     # the size the save recorded (its check)
    assert cli.main(["train", "examples/sort.toml", "--out", str(run), *TINY, "--train.steps=3", "--resume"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
            if '"time/step_s"' in line][-1]
    assert last["step"] == 3 and summary["cost/step_seconds"] == pytest.approx(last["time/step_s"], rel=1e-9)
    assert summary["cost/eval_seconds"] == 0.0 and summary["cost/sampled_tokens"] == 3 * 4 * 4 * 3
