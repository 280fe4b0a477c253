"""The `rlvr` command line: price, errors on bad input, lab, help, and the installed console command.

Bad input must be a clear error (exit code 2, a message on stderr naming the key or path) before
anything is written; these tests check the message and that the run directory was not created.
Only two tests train (one step each: `--overwrite`, and an empty `--out`); the rest build at most a
task and a tiny model.
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from rlvr import build as build_mod, config as config_mod, probes
from rlvr.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sort.toml"
TINY = [
    "--model.init=", "--task.path=rlvr.tasks.sort:sort_task", "--task.reward=position", "--task.reward_weights={}",
    "--sampling.max_new_tokens=0", "--algorithm.kl_coef=0", "--algorithm.top_k=0", "--train.threads=2",
    "--model.n_embd=32", "--model.n_layer=1", "--model.n_head=2",
    "--train.steps=1", "--train.prompts_per_step=4", "--train.samples_per_prompt=4",
    "--train.epochs_per_batch=1", "--train.minibatches=1",
    "--eval.every=0", "--eval.prompts=5", "--eval.pass_k=0",
    "--task.options={n = 3, heldout = 50}",
]
# P=4, G=4, T=3 (3-digit sort), μ=2, minibatches=2, 5 steps
PRICED = [*TINY, "--train.epochs_per_batch=2", "--train.minibatches=2", "--train.steps=5"]


def cli(*argv) -> tuple[int, str, str]:
    """`rlvr ARGV` in-process: (exit status as the shell would see it, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:  # argparse, or a message given to SystemExit (Python prints it, status 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
                rc = 1
            else:
                rc = e.code or 0
    return rc, out.getvalue(), err.getvalue()


def n_params(*overrides: str) -> int:
    return build_mod.build(config_mod.load(EXAMPLE, list(overrides))).model.num_params()


# --------------------------------------------------------------------------- price


def test_price_json_arithmetic():
    rc, out, err = cli("price", EXAMPLE, *PRICED, "--json")
    assert rc == 0, err
    p = json.loads(out)
    n = n_params(*PRICED)
    assert (p["prompts_per_step"], p["samples_per_prompt"], p["max_new_tokens"]) == (4, 4, 3)
    assert p["grad_steps_per_batch"] == 4
    assert p["sampled_tokens_per_batch"] == 48          # 4 * 4 * 3
    assert p["sampled_tokens_per_grad_step"] == 12      # 48 / (2 * 2)
    assert p["sampled_tokens_per_run"] == 5 * 48
    assert p["prompt_tokens"] == 4                      # "123="
    assert p["n_params"] == n > 0
    assert p["policy_bytes"] == 4 * n
    assert p["optimizer_bytes"] == 2 * 4 * n
    assert p["logp_old_bytes"] == 48 * 4
    assert p["has_reference"] is False and p["reference_bytes"] == 0


def test_price_with_kl_holds_a_reference_copy():
    rc, out, err = cli("price", EXAMPLE, *PRICED, "--algorithm.kl_coef=0.1", "--json")
    assert rc == 0, err
    p = json.loads(out)
    assert p["has_reference"] is True
    assert p["reference_bytes"] == p["policy_bytes"] == 4 * n_params(*PRICED)


def test_price_text_lines():
    rc, out, err = cli("price", EXAMPLE, *PRICED)
    assert rc == 0, err
    assert "sampled tokens per gradient step = 12 (P=4 x G=4 x T<=3 / 4 gradient steps per batch)" in out
    assert "sampled tokens per batch = 48; per run (5 steps) = 240" in out
    assert "no reference (kl_coef = 0)" in out


def test_price_probes_false_times_neither_probe(monkeypatch):
    """`rlvr price` times a decode step and a learn part on the run's policy for the expected wall
    time; `train.price_probes = false` runs neither (none of their calls happens), and the price
    gives the FLOP lower bound alone, the same figures otherwise."""
    import rlvr.learn

    calls = []
    real_decode, real_learn = probes.decode_step_seconds, rlvr.learn.learn_part_seconds
    monkeypatch.setattr(probes, "decode_step_seconds", lambda setup: calls.append("decode") or real_decode(setup))
    monkeypatch.setattr(rlvr.learn, "learn_part_seconds", lambda setup: calls.append("learn") or real_learn(setup))
    rc, out, err = cli("price", EXAMPLE, *PRICED, "--json")
    assert rc == 0, err
    assert calls == ["decode", "learn"]
    probed = json.loads(out)
    assert probed["wall_seconds_expected"] > 0 and probed["decode_step_s"] > 0 and probed["learn_part_s"] > 0
    calls.clear()
    rc, out, err = cli("price", EXAMPLE, *PRICED, "--train.price_probes=false", "--json")
    assert rc == 0, err
    assert calls == []
    bare = json.loads(out)
    assert bare["wall_seconds_expected"] == 0 and bare["decode_step_s"] == 0 and bare["learn_part_s"] == 0
    assert bare["wall_seconds_estimate"] > 0 and bare["flops_per_run"] == probed["flops_per_run"]
    assert bare["sampled_tokens_per_run"] == probed["sampled_tokens_per_run"]
    rc, out, err = cli("price", EXAMPLE, *PRICED, "--train.price_probes=false")
    assert rc == 0, err
    assert "price: wall time >= " in out and "expected ~" not in out


def test_price_task_bound_follows_sampling_max_new_tokens():
    rc, out, err = cli("price", EXAMPLE, *PRICED, "--sampling.max_new_tokens=5", "--json")
    assert rc == 0, err
    p = json.loads(out)
    assert p["max_new_tokens"] == 5 and p["sampled_tokens_per_batch"] == 4 * 4 * 5


def test_price_json_holds_the_json_alone_and_the_builds_notes_go_to_stderr(monkeypatch):
    """A model source's note (a GGUF's cached copy, say) is printed while the run is built; under
    --json it goes to stderr, so stdout parses as JSON; without --json it is printed as before."""
    real = build_mod.build

    def noting(cfg, log=print, **kw):
        log("note: a model source's message")
        return real(cfg, log=log, **kw)

    monkeypatch.setattr(build_mod, "build", noting)
    rc, out, err = cli("price", EXAMPLE, *PRICED, "--model.autocast=off", "--json")
    assert rc == 0 and json.loads(out)["numerics"] == "fp32 (model.autocast = off)"
    assert "note: a model source's message" in err and "note:" not in out
    rc, out, _ = cli("price", EXAMPLE, *PRICED, "--model.autocast=off")
    assert rc == 0 and "note: a model source's message" in out


def test_installed_console_command_prices_a_run():
    exe = Path(sys.executable).with_name("rlvr")
    exe = str(exe) if exe.exists() else shutil.which("rlvr")
    assert exe, "the rlvr console script is not installed"
    # the numerics are set, not measured: this test compares two processes, not this machine's speeds
    argv = [*PRICED, "--model.autocast=off", "--json"]
    proc = subprocess.run([exe, "price", str(EXAMPLE), *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # measured in each process: this machine's speed, and the memory baseline (so the predicted peak)
    measured = ("matmul_flops_per_s", "wall_seconds_expected", "memory_baseline_bytes", "memory_peak_bytes",
                "memory_counted_peak_bytes", "decode_step_s", "learn_part_s", "optimizer_step_s", "wall_seconds_estimate")
    got, want = json.loads(proc.stdout), json.loads(cli("price", EXAMPLE, *argv)[1])
    assert all(got.pop(k) > 0 and want.pop(k) > 0 for k in measured)
    # a learn part's resident peak: measured in both or in neither (a part of more than two groups)
    assert (got.pop("memory_learn_measured_bytes") > 0) == (want.pop("memory_learn_measured_bytes") > 0)
    got.pop("memory_peak_phase"), want.pop("memory_peak_phase")    # a measured peak can tip it either way
    assert got["numerics"] == "fp32 (model.autocast = off)" and got["memory_weight_copy_bytes"] == 0
    assert got == want


# --------------------------------------------------------------------------- bad input

BROKEN_TASKS = {
    "max_new_tokens": '''
from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Example, Task
r = Reward("exact", lambda p, s, a: 1.0, RewardCard(pays_for="x", ignores="y", exploit="z"))
TASK = Task(name="broken", train=[Example("1=", "1")], heldout=[Example("2=", "2")], rewards={"exact": r},
            goal=lambda p, s, a: True, max_new_tokens=0)
''',
    "heldout overlaps train": '''
from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Example, Task
r = Reward("exact", lambda p, s, a: 1.0, RewardCard(pays_for="x", ignores="y", exploit="z"))
TASK = Task(name="leaky", train=[Example("1=", "1")], heldout=[Example("1=", "1")], rewards={"exact": r},
            goal=lambda p, s, a: True, max_new_tokens=2)
''',
    "RewardCard": '''
from rlvr.rewards import Reward
from rlvr.tasks import Example, Task
r = Reward("exact", lambda p, s, a: 1.0, None)
TASK = Task(name="uncarded", train=[Example("1=", "1")], heldout=[Example("2=", "2")], rewards={"exact": r},
            goal=lambda p, s, a: True, max_new_tokens=2)
''',
}


def assert_refused(rc: int, err: str, out_dir: Path, *needles: str) -> None:
    assert rc == 2, err
    assert err.startswith("rlvr: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not out_dir.exists(), "an error must come before anything is written"


def test_nonexistent_task_path(tmp_path):
    out = tmp_path / "run"
    rc, _, err = cli("train", EXAMPLE, *TINY, "--task.path=nope.py:X", "--out", out)
    assert_refused(rc, err, out, "nope.py:X", "does not exist")


def test_task_module_that_does_not_import(tmp_path):
    out = tmp_path / "run"
    rc, _, err = cli("train", EXAMPLE, *TINY, "--task.path=rlvr.tasks.nosuchmodule:TASK", "--out", out)
    assert_refused(rc, err, out, "rlvr.tasks.nosuchmodule")


def test_task_name_missing_in_module_lists_candidates(tmp_path):
    out = tmp_path / "run"
    rc, _, err = cli("train", EXAMPLE, *TINY, "--task.path=rlvr.tasks.sort:nope", "--out", out)
    assert_refused(rc, err, out, "rlvr.tasks.sort:nope", "sort_task")


@pytest.mark.parametrize("field", list(BROKEN_TASKS))
def test_task_that_breaks_the_contract(tmp_path, field):
    path = tmp_path / "broken.py"
    path.write_text(BROKEN_TASKS[field])
    out = tmp_path / "run"
    rc, _, err = cli("train", EXAMPLE, *TINY, f"--task.path={path}:TASK", "--task.options={}",
                     "--task.reward=exact", "--out", out)
    assert_refused(rc, err, out, str(path), "breaks the contract", field)


def test_bad_task_options_name_the_call(tmp_path):
    out = tmp_path / "run"
    rc, _, err = cli("train", EXAMPLE, *TINY, "--task.options={n = 3, bogus = 1}", "--out", out)
    assert_refused(rc, err, out, "bogus")


REVERSE_TASK = '''
from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Example, Task


def reverse(n=3, count=40):
    words = [format(i, "03d")[:n] for i in range(count)]
    ex = [Example(prompt=w + "=", answer=w[::-1]) for w in words]
    card = RewardCard(pays_for="the reversed string", ignores="nothing", exploit="none known")
    exact = Reward("exact", lambda p, r, a: float(r == a), card)
    return Task(name="reverse", train=ex[:30], heldout=ex[30:], rewards={"exact": exact},
                goal=lambda p, r, a: r == a, max_new_tokens=n, alphabet="0123456789=")
'''


def test_changed_task_path_refuses_the_old_options_and_lists_the_new_ones(tmp_path):
    """examples/sort.toml sets options {n, low, high, heldout}; reverse() takes n and count."""
    task = tmp_path / "rev.py"
    task.write_text(REVERSE_TASK)
    out = tmp_path / "run"
    rc, _, err = cli("train", EXAMPLE, f"--task.path={task}:reverse", "--task.reward=exact", "--out", out)
    assert_refused(rc, err, out, "'low', 'high', 'heldout'", "not taken by reverse()", "it takes: n, count",
                   "--task.options=")
    # replacing the table, or merging one option into an empty one, is accepted
    rc, out_text, err = cli("price", EXAMPLE, f"--task.path={task}:reverse", "--task.reward=exact",
                            "--task.options={}", "--task.options.n=2", "--train.prompts_per_step=8")
    assert rc == 0, err
    assert "T<=2" in out_text


def test_one_option_from_the_command_line_merges_into_the_file(tmp_path):
    rc, out, err = cli("price", EXAMPLE, "--task.options.n=6", "--json")
    assert rc == 0, err
    assert json.loads(out)["max_new_tokens"] == 6  # n=6 digits; low/high/heldout still from the file


def test_help_lists_every_command_and_says_what_rlvr_does():
    rc, out, _ = cli("--help")
    assert rc == 0
    body = out.split("\n\n", 1)[1]  # after the usage line
    assert body.startswith("rlvr fine-tunes a language model with policy-gradient reinforcement learning")
    for command in ("train", "eval", "price", "probe", "audit", "report", "lab"):
        assert f"rlvr {command} " in out, command
    assert "--resume" in out and "docs/background.md" in out


@pytest.mark.parametrize("override,needles", [
    ("--train.stepz=3", ["train.stepz", "command line", "did you mean 'steps'?", "samples_per_prompt"]),
    ("--trian.steps=3", ["[trian]", "did you mean 'train'?", "known"]),
    ("--train.samples_per_prompt=0", ["train.samples_per_prompt: must be >= 1, got 0 (command line)"]),
    ("--train.steps=three", ["train.steps", "expected an integer"]),
    ("--train.lr=fast", ["train.lr", "expected a number"]),
    ("--algorithm.scheme=best", ["algorithm.scheme", "'normalized'"]),
    ("--algorithm.scheme=baseline", ["algorithm.scheme", "baseline"]),
    ("--train.samples_per_prompt=0", ["train.samples_per_prompt", ">= 1"]),
    ("--model.n_head=3", ["model.n_head", "n_embd"]),
    ("--task.options=[1, 2]", ["task.options", "table"]),
])
def test_bad_config_value_names_the_key(tmp_path, override, needles):
    out = tmp_path / "run"
    rc, _, err = cli("train", EXAMPLE, *TINY, override, "--out", out)
    assert_refused(rc, err, out, *needles)


def test_wrong_type_in_the_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nn_layer = 1\n\n[train]\nlr = 0.01\nsteps = "ten"\n')
    out = tmp_path / "run"
    rc, _, err = cli("train", bad, "--out", out)
    assert_refused(rc, err, out, "train.steps", f"{bad}:6", "expected an integer")


def test_missing_config_file(tmp_path):
    out = tmp_path / "run"
    rc, _, err = cli("train", tmp_path / "absent.toml", "--out", out)
    assert_refused(rc, err, out, "absent.toml", "does not exist")


def test_unknown_reward_names_the_available_ones(tmp_path):
    out = tmp_path / "run"
    rc, _, err = cli("train", EXAMPLE, *TINY, "--task.reward=nonexistent", "--out", out)
    assert_refused(rc, err, out, "task.reward", "'nonexistent'", "exact", "position", "inclusion_adjacency")


def test_unknown_reward_weight_names_the_key(tmp_path):
    out = tmp_path / "run"
    rc, _, err = cli("train", EXAMPLE, *TINY, "--task.reward_weights={exact = 1.0, speed = 0.5}", "--out", out)
    assert_refused(rc, err, out, "task.reward_weights", "'speed'", "position")


def test_price_refuses_bad_config_too(tmp_path):
    rc, out, err = cli("price", EXAMPLE, *TINY, "--train.stepz=1", "--json")
    assert rc == 2 and "train.stepz" in err and out == ""


def test_existing_run_is_refused_then_overwritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    old_summary = b'{"eval/goal": 0.123, "note": "a run that must not be clobbered"}\n'
    (run / "summary.json").write_bytes(old_summary)
    (run / "metrics.jsonl").write_bytes(b'{"step": 1}\n')
    (run / "config.toml").write_bytes(b"[train]\nsteps = 1\n")  # with metrics.jsonl: a run rlvr wrote
    rc, _, err = cli("train", EXAMPLE, *TINY, "--out", run)
    assert rc == 2 and "--overwrite" in err and str(run) in err, err
    assert (run / "summary.json").read_bytes() == old_summary
    assert (run / "metrics.jsonl").read_bytes() == b'{"step": 1}\n'
    assert sorted(p.name for p in run.iterdir()) == ["config.toml", "metrics.jsonl", "summary.json"]  # nothing added

    rc, out, err = cli("train", EXAMPLE, *TINY, "--out", run, "--overwrite")
    assert rc == 0, err
    summary = json.loads((run / "summary.json").read_text())
    assert "note" not in summary and summary["steps"] == 1 and "eval/goal" in summary
    assert (run / "checkpoint" / "model.safetensors").is_file()
    # the step-0 evaluation, one step, the final evaluation
    assert [json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 1]


def test_empty_existing_out_dir_is_fine(tmp_path):
    run = tmp_path / "empty"
    run.mkdir()
    rc, _, err = cli("train", EXAMPLE, *TINY, "--out", run)
    assert rc == 0, err
    assert (run / "summary.json").is_file()


def test_out_pointing_at_a_file_is_a_clear_error(tmp_path):
    target = tmp_path / "afile"
    target.write_text("keep me")
    rc, _, err = cli("train", EXAMPLE, *TINY, "--out", target)
    assert rc == 2 and str(target) in err
    assert target.read_text() == "keep me"


def test_unrecognised_argument_exits_2(tmp_path):
    out = tmp_path / "run"
    rc, _, err = cli("train", EXAMPLE, *TINY, "--steps=3", "--out", out)
    assert "--steps=3" in err and "--train.steps" in err and not out.exists()
    assert rc == 2


def test_eval_refuses_a_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    rc, out, err = cli("eval", tmp_path)
    assert rc == 2 and out == ""
    assert "not a finished run" in err and str(tmp_path / "config.toml") in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_eval_names_a_missing_checkpoint(tmp_path):
    (tmp_path / "config.toml").write_text(config_mod.to_toml(config_mod.load(EXAMPLE, TINY)))
    rc, _, err = cli("eval", tmp_path)
    assert rc == 2 and "model.safetensors" in err, err


# --------------------------------------------------------------------------- lab and help


def test_lab_prints_the_worked_figures():
    rc, out, err = cli("lab")
    assert rc == 0, err
    assert "gradient (0.16, -0.06, -0.08, -0.02)" in out
    assert "bandit final probs [0.003, 0.003, 0.994]" in out
    assert "four-answer policy" in out and "bandit:" in out  # each figure says what produced it


def test_lab_bandit_prints_a_line_per_learning_rate():
    rc, out, err = cli("lab", "bandit", "--seeds", "5")
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["lr 5", "lr 0.5"]
    assert all("(5 seeds" in line and "solved" in line and "locked_wrong" in line for line in lines)
    rc, out, _ = cli("lab", "bandit", "--seeds", "2", "--steps", "20", "--lr", "1", "2", "3")
    assert rc == 0 and [line.split(":")[0] for line in out.strip().splitlines()] == ["lr 1", "lr 2", "lr 3"]


def test_train_help_lists_every_key_with_its_docstring():
    rc, out, _ = cli("train", "--help")
    assert rc == 0
    assert "--train.samples_per_prompt=8" in out
    assert "G: responses sampled per prompt (the group that forms the baseline)." in out
    for section, cls in config_mod.SECTIONS.items():
        docs = config_mod.field_docs(cls)
        for f in dataclasses.fields(cls):
            assert f"--{section}.{f.name}=" in out, f"{section}.{f.name} missing from --help"
            assert docs.get(f.name), f"{section}.{f.name} has no docstring"
            assert docs[f.name] in " ".join(out.split()), f"{section}.{f.name}: docstring missing from --help"


def test_price_refuses_a_task_without_a_response_bound(tmp_path, capsys):
    task = tmp_path / "nobound.py"
    task.write_text("from rlvr.tasks.sort import sort_task\n\n"
                    "def make():\n    t = sort_task(n=3, heldout=10)\n    t.max_new_tokens = None\n    return t\n")
    rc = main(["price", "examples/sort.toml", f"--task.path={task}:make", "--task.options={}"])
    assert rc == 2
    assert "max_new_tokens must be a positive int, got None" in capsys.readouterr().err


def test_device_choice_is_checked_before_any_compute(tmp_path, capsys):
    import torch

    out = tmp_path / "run"
    if not torch.cuda.is_available():
        rc = main(["train", "examples/sort.toml", "--out", str(out), *TINY, "--train.device=cuda"])
        assert rc == 2 and "train.device = 'cuda'" in capsys.readouterr().err and not out.exists()
    rc = main(["train", "examples/sort.toml", "--out", str(out), *TINY, "--train.device=bogus"])
    assert rc == 2 and "train.device = 'bogus'" in capsys.readouterr().err
    rc = main(["train", "examples/sort.toml", "--out", str(out), *TINY, "--train.device=auto", "--train.steps=1",
               "--eval.prompts=5", "--eval.pass_k=0"])
    assert rc == 0


@pytest.mark.parametrize("command", ["probe", "audit", "price", "train"])
def test_stray_argument_is_a_clear_error(command, capsys):
    assert main([command, "examples/sort.toml", "--bogus"]) == 2
    assert "unrecognised argument '--bogus'" in capsys.readouterr().err
