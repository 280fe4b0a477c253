"""Every bad input is refused before any compute: exit 2 and one message that names the key, file and line.

One row per input: the files it needs (written under a fresh directory, ``{tmp}`` in a path or a text
is that directory), the `rlvr` arguments, the exit code, and fragments the message must hold. Each runs
in-process through `rlvr.cli.main`; a refusal of `rlvr train` must leave `--out` unwritten.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from rlvr.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "sort.toml")
TINY = ["--model.n_embd=32", "--model.n_layer=1", "--model.n_head=2", "--train.steps=1",
        "--train.prompts_per_step=4", "--train.samples_per_prompt=4", "--eval.every=0", "--eval.prompts=5",
        "--eval.pass_k=0", "--task.options={n = 3, heldout = 50}", "--train.threads=1"]
OUT = ["--out", "{tmp}/run"]


def train_file(*extra):
    """`rlvr train {tmp}/c.toml --out {tmp}/run`: the row's own c.toml, defaults for the rest."""
    return ["train", "{tmp}/c.toml", *OUT, *extra]


def train_cli(*overrides):
    """`rlvr train examples/sort.toml` with small sizes and the row's overrides."""
    return ["train", EXAMPLE, *TINY, *overrides, *OUT]


def jsonl(*extra):
    return train_cli("--task.path=rlvr.tasks.dataset:jsonl_task", "--task.reward=exact_match", *extra)


DATA = '{"prompt": "ab", "answer": "ba"}\n{"prompt": "cd", "answer": "dc"}\n{"prompt": "ef", "answer": "fe"}\n'

# (id, files, argv, exit code, fragments of the message)
ROWS = [
    # --- the config file itself
    ("toml_not_utf8", {"c.toml": b"[train]\nsteps = 3\n# caf\xe9\n"}, train_file(), 2,
     ["{tmp}/c.toml:3", "not UTF-8", "0xe9"]),
    ("config_is_a_directory", {"c.toml/keep": "x"}, train_file(), 2, ["{tmp}/c.toml", "is a directory"]),
    ("config_missing", {}, train_file(), 2, ["{tmp}/c.toml", "does not exist"]),
    ("toml_syntax", {"c.toml": "[train\nsteps = 3\n"}, train_file(), 2, ["{tmp}/c.toml", "not valid TOML"]),
    ("top_level_key", {"c.toml": "steps = 3\n"}, train_file(), 2, ["steps", "{tmp}/c.toml:1", "sections"]),
    ("unknown_section", {"c.toml": "[trian]\nsteps = 5\n"}, train_file(), 2,
     ["unknown section [trian]", "{tmp}/c.toml:2"]),
    ("unknown_key", {"c.toml": "[train]\nsteps = 5\nstepz = 3\n"}, train_file(), 2,
     ["train.stepz", "{tmp}/c.toml:3", "samples_per_prompt"]),
    # --- types, with file and line
    ("string_for_int", {"c.toml": "[train]\n\nsteps = \"ten\"\n"}, train_file(), 2,
     ["train.steps", "{tmp}/c.toml:3", "expected an integer"]),
    ("float_for_int", {"c.toml": "[train]\nprompts_per_step = 1.5\n"}, train_file(), 2,
     ["train.prompts_per_step", "{tmp}/c.toml:2", "expected an integer"]),
    ("bool_for_number", {"c.toml": "[train]\nlr = true\n"}, train_file(), 2,
     ["train.lr", "{tmp}/c.toml:2", "expected a number"]),
    ("string_for_bool", {"c.toml": "[eval]\nkeep_best = \"yes\"\n"}, train_file(), 2,
     ["eval.keep_best", "{tmp}/c.toml:2", "true or false"]),
    ("bad_choice", {"c.toml": "[algorithm]\nscheme = \"gpro\"\n"}, train_file(), 2,
     ["algorithm.scheme", "{tmp}/c.toml:2", "must be one of"]),
    ("infinite_lr", {"c.toml": "[train]\nlr = inf\n"}, train_file(), 2, ["train.lr", "{tmp}/c.toml:2", "finite"]),
    ("list_for_table", {"c.toml": "[task]\noptions = [1, 2]\n"}, train_file(), 2,
     ["task.options", "{tmp}/c.toml:2", "table"]),
    # --- ranges, with file and line
    ("steps_zero", {"c.toml": "[train]\n# run length\nsteps = 0\n"}, train_file(), 2,
     ["train.steps: must be >= 1, got 0", "{tmp}/c.toml:3"]),
    ("negative_lr", {"c.toml": "[train]\nlr = -0.1\n"}, train_file(), 2, ["train.lr: must be > 0", "{tmp}/c.toml:2"]),
    ("top_p_above_1", {"c.toml": "[sampling]\ntop_p = 1.5\n"}, train_file(), 2,
     ["sampling.top_p", "(0, 1]", "{tmp}/c.toml:2"]),
    ("clip_eps_above_1", {"c.toml": "[algorithm]\nclip_eps = 1.5\n"}, train_file(), 2,
     ["algorithm.clip_eps", "{tmp}/c.toml:2"]),
    ("negative_kl", {"c.toml": "[algorithm]\nkl_coef = -1.0\n"}, train_file(), 2,
     ["algorithm.kl_coef: must be >= 0", "{tmp}/c.toml:2"]),
    ("negative_warmup", {"c.toml": "[train]\nwarmup_steps = -5\n"}, train_file(), 2,
     ["train.warmup_steps", "{tmp}/c.toml:2"]),
    ("betas_not_two", {"c.toml": "[train]\nbetas = [0.9]\n"}, train_file(), 2, ["train.betas", "{tmp}/c.toml:2"]),
    ("n_head_does_not_divide", {"c.toml": "[model]\nn_embd = 30\nn_head = 4\n"}, train_file(), 2,
     ["model.n_head", "n_embd = 30", "{tmp}/c.toml:3"]),
    ("minibatches_over_groups", {"c.toml": "[train]\nprompts_per_step = 2\nminibatches = 4\n"}, train_file(), 2,
     ["train.minibatches", "{tmp}/c.toml:3"]),
    ("top_k_over_group", {"c.toml": "[algorithm]\ntop_k = 9\n"}, train_file(), 2,
     ["algorithm.top_k", "{tmp}/c.toml:2"]),
    ("baseline_in_training", {"c.toml": "[algorithm]\nscheme = \"baseline\"\n"}, train_file(), 2,
     ["algorithm.scheme", "B(S)", "{tmp}/c.toml:2"]),
    ("lora_without_hf_model", {"c.toml": "[model]\nlora_r = 8\n"}, train_file(), 2,
     ["model.lora_r", "Hugging Face", "{tmp}/c.toml:2"]),
    ("init_and_path", {"c.toml": "[model]\ninit = \"a\"\npath = \"b\"\n"}, train_file(), 2,
     ["model.init", "{tmp}/c.toml:2"]),
    ("reward_weight_not_a_number", {"c.toml": "[task]\nreward_weights = { position = \"high\" }\n"}, train_file(), 2,
     ["task.reward_weights.position", "finite number", "{tmp}/c.toml:2"]),
    ("reward_workers_below_minus_1", {"c.toml": "[task]\nreward_workers = -2\n"}, train_file(), 2,
     ["task.reward_workers", "{tmp}/c.toml:2"]),
    ("reward_timeout_zero", {"c.toml": "[task]\nreward_timeout_s = 0\n"}, train_file(), 2,
     ["task.reward_timeout_s: must be > 0", "{tmp}/c.toml:2"]),
    ("reward_memory_negative", {"c.toml": "[task]\nreward_memory_mb = -1\n"}, train_file(), 2,
     ["task.reward_memory_mb", "{tmp}/c.toml:2"]),
    # --- accepted by the types, useless in a run
    ("temperature_zero", {"c.toml": "[sampling]\ntemperature = 0.0\n"}, train_file(), 2,
     ["sampling.temperature", "> 0", "{tmp}/c.toml:2"]),
    ("temperature_1e-30", {"c.toml": "[sampling]\ntemperature = 1e-30\n"}, train_file(), 2,
     ["sampling.temperature", "too small to sample from", "{tmp}/c.toml:2"]),
    ("one_sample_centered", {"c.toml": "[algorithm]\nscheme = \"centered\"\n[train]\nsamples_per_prompt = 1\n"},
     train_file(), 2, ["train.samples_per_prompt", "{tmp}/c.toml:4", "'centered' ({tmp}/c.toml:2)", "every Δ is 0"]),
    ("one_sample_normalized_default", {"c.toml": "[train]\nsamples_per_prompt = 1\n"}, train_file(), 2,
     ["train.samples_per_prompt", "{tmp}/c.toml:2", "'normalized' (default)", "every Δ is 0"]),
    ("one_sample_loo", {"c.toml": "[algorithm]\nscheme = \"loo\"\n[train]\nsamples_per_prompt = 1\n"}, train_file(), 2,
     ["train.samples_per_prompt", "{tmp}/c.toml:4", "'loo'"]),
    ("one_sample_batch_normalized",
     {"c.toml": "[algorithm]\nscheme = \"batch_normalized\"\n[train]\nsamples_per_prompt = 1\n"}, train_file(), 2,
     ["train.samples_per_prompt", "'batch_normalized'", "{tmp}/c.toml:4"]),
    ("one_sample_dynamic_sampling",
     {"c.toml": "[algorithm]\nscheme = \"raw\"\ndynamic_sampling = true\n[train]\nsamples_per_prompt = 1\n"},
     train_file(), 2, ["algorithm.dynamic_sampling", "{tmp}/c.toml:3", "always agrees"]),
    ("max_new_tokens_100000", {"c.toml": "[sampling]\nmax_new_tokens = 100000\n"}, train_file(), 2,
     ["sampling.max_new_tokens", "8192", "{tmp}/c.toml:2"]),
    # --- the command line
    ("cli_range", {}, train_cli("--train.steps=-1"), 2, ["train.steps: must be >= 1", "(command line)"]),
    ("cli_type", {}, train_cli("--train.lr=fast"), 2, ["train.lr", "command line", "expected a number"]),
    ("cli_temperature_0.001", {}, train_cli("--sampling.temperature=0.001"), 2,
     ["sampling.temperature", "too small", "(command line)"]),
    ("cli_one_sample", {}, train_cli("--train.samples_per_prompt=1"), 2,
     ["train.samples_per_prompt", "(command line)", "'normalized' (", "sort.toml:"]),
    ("cli_unrecognised", {}, train_cli("--steps=3"), 2, ["--steps=3", "--train.steps"]),
    ("cli_unknown_section", {}, train_cli("--trian.steps=3"), 2, ["[trian]", "known"]),
    ("cli_not_a_table", {}, train_cli("--task.options=[1, 2]"), 2, ["task.options", "table"]),
    ("cli_bad_toml_value", {}, train_cli("--task.options={n = }"), 2, ["task.options", "not a TOML dict"]),
    ("cli_no_equals", {}, ["train", EXAMPLE, "--train.steps", *OUT], 2, ["--train.steps"]),
    # --- the task
    ("task_file_missing", {}, train_cli("--task.path={tmp}/nope.py:make"), 2,
     ["{tmp}/nope.py:make", "does not exist"]),
    ("task_exits_at_import", {"leave.py": "import sys\nsys.exit(0)\n"}, train_cli("--task.path={tmp}/leave.py:TASK"), 2,
     ["{tmp}/leave.py:TASK", "raised SystemExit(0)"]),
    ("task_factory_exits", {"leave.py": "import sys\ndef make(**kw):\n    sys.exit(1)\n"},
     train_cli("--task.path={tmp}/leave.py:make"), 2, ["{tmp}/leave.py:make", "calling make", "SystemExit(1)"]),
    ("task_raises_at_import", {"boom.py": "raise RuntimeError('boom')\n"}, train_cli("--task.path={tmp}/boom.py:TASK"),
     2, ["{tmp}/boom.py", "failed to import: RuntimeError: boom"]),
    ("task_module_missing", {}, train_cli("--task.path=rlvr.tasks.nosuch:TASK"), 2,
     ["no module named 'rlvr.tasks.nosuch'"]),
    ("task_name_missing", {}, train_cli("--task.path=rlvr.tasks.sort:nope"), 2, ["has no 'nope'", "sort_task"]),
    ("task_option_unknown", {}, train_cli("--task.options={n = 3, bogus = 1}"), 2, ["bogus"]),
    ("unknown_reward", {}, train_cli("--task.reward=nonexistent"), 2, ["task.reward", "'nonexistent'", "position"]),
    ("unknown_reward_weight", {}, train_cli("--task.reward_weights={speed = 1.0}"), 2,
     ["task.reward_weights", "'speed'"]),
    # --- data files
    ("jsonl_not_utf8", {"d.jsonl": b'{"prompt": "ab", "answer": "ba"}\n{"prompt": "\xff", "answer": "c"}\n'},
     jsonl('--task.options={train = "{tmp}/d.jsonl"}'), 2, ["{tmp}/d.jsonl:2", "not UTF-8", "0xff"]),
    ("jsonl_bad_json", {"d.jsonl": DATA + '{"prompt": "gh", "answer": }\n'},
     jsonl('--task.options={train = "{tmp}/d.jsonl"}'), 2, ["{tmp}/d.jsonl:4", "not valid JSON"]),
    ("jsonl_is_a_directory", {"data/keep": "x"}, jsonl('--task.options={train = "{tmp}/data"}'), 2,
     ["{tmp}/data", "is a directory"]),
    ("jsonl_missing", {}, jsonl('--task.options={train = "{tmp}/absent.jsonl"}'), 2,
     ["{tmp}/absent.jsonl", "does not exist"]),
    ("jsonl_no_prompt_column", {"d.jsonl": '{"question": "ab", "answer": "ba"}\n'},
     jsonl('--task.options={train = "{tmp}/d.jsonl"}'), 2, ["{tmp}/d.jsonl:1", "no prompt column 'prompt'"]),
    ("jsonl_not_an_object", {"d.jsonl": DATA + "[1, 2]\n"}, jsonl('--task.options={train = "{tmp}/d.jsonl"}'), 2,
     ["{tmp}/d.jsonl:4", "expected a JSON object"]),
    # --- the output directory and resuming
    ("out_is_a_file", {"afile": "keep me"}, ["train", EXAMPLE, *TINY, "--out", "{tmp}/afile"], 2,
     ["{tmp}/afile", "is a file"]),
    ("out_holds_a_run", {"run/metrics.jsonl": "{}\n"}, train_cli(), 2, ["{tmp}/run", "--overwrite"]),
    ("resume_without_out", {}, ["train", EXAMPLE, *TINY, "--resume"], 2, ["--resume needs --out"]),
    ("resume_without_state", {}, train_cli("--resume"), 2, ["no resumable state"]),
    ("resume_and_overwrite", {}, train_cli("--resume", "--overwrite"), 2, ["contradict"]),
    # --- other commands
    ("eval_not_a_run", {"notes.txt": "hello"}, ["eval", "{tmp}"], 2, ["not a finished run", "{tmp}/config.toml"]),
    ("price_unknown_key", {}, ["price", EXAMPLE, "--train.stepz=1"], 2, ["train.stepz"]),
    ("price_not_utf8", {"c.toml": b"[train]\nsteps = 3 # \xe9\n"}, ["price", "{tmp}/c.toml"], 2,
     ["{tmp}/c.toml:2", "not UTF-8"]),
    ("probe_config_is_a_directory", {"c.toml/keep": "x"}, ["probe", "{tmp}/c.toml"], 2, ["is a directory"]),
    ("audit_range", {"c.toml": "[sampling]\ntemperature = 1e-9\n"}, ["audit", "{tmp}/c.toml"], 2,
     ["sampling.temperature", "{tmp}/c.toml:2"]),
    # --- sizes and ranges that overflowed, ran for minutes or turned a limit off
    ("seed_overflow", {}, train_cli("--train.seed=99999999999999999999999"), 2,
     ["train.seed", "exceeds the largest seed", "(command line)"]),
    ("reward_timeout_1e300", {}, train_cli("--task.reward_timeout_s=1e300"), 2,
     ["task.reward_timeout_s", "exceeds the limit", "(command line)"]),
    ("reward_memory_off_by_size", {}, train_cli("--task.reward_memory_mb=10000000000000"), 2,
     ["task.reward_memory_mb", "set 0 for no limit", "(command line)"]),
    ("sort_n_1e9", {}, train_cli("--task.options.n=1000000000"), 2,
     ["sort_task", "option n = 1,000,000,000", "8,192"]),
    ("sort_heldout_1e9", {}, train_cli("--task.options.heldout=1000000000"), 2,
     ["sort_task", "option heldout = 1,000,000,000", "exceeds the limit"]),
    ("eval_prompts_negative", {"notes.txt": "hello"}, ["eval", "{tmp}", "--prompts", "-3"], 2,
     ["--prompts -3", "must be >= 1"]),
    ("lab_bandit_no_seeds", {}, ["lab", "bandit", "--seeds", "0"], 2, ["lab bandit", "seeds", ">= 1"]),
    # --- a UTF-8 byte-order mark is read past (the error below is on line 2, not "at line 1, column 1")
    ("toml_bom", {"c.toml": b"\xef\xbb\xbf[train]\nsteps = 0\n"}, train_file(), 2,
     ["train.steps: must be >= 1, got 0", "{tmp}/c.toml:2"]),
    ("jsonl_bom", {"d.jsonl": b"\xef\xbb\xbf" + DATA.encode() + b'{"prompt": "gh", "answer": }\n'},
     jsonl('--task.options={train = "{tmp}/d.jsonl"}'), 2, ["{tmp}/d.jsonl:4", "not valid JSON"]),
]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def write_files(tmp: Path, files: dict) -> None:
    for name, content in files.items():
        p = tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content.replace("{tmp}", str(tmp)))


def test_there_are_at_least_40_rows():
    assert len(ROWS) >= 40 and len({r[0] for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("name, files, argv, code, needles", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_refused_before_compute(tmp_path, name, files, argv, code, needles):
    write_files(tmp_path, files)
    rc, out, err = run_cli([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert rc == code, err
    assert "Traceback" not in err and err.startswith("rlvr: error: "), err
    for needle in needles:
        assert needle.replace("{tmp}", str(tmp_path)) in err, (needle, err)
    if argv[0] == "train" and "{tmp}/run" in argv and "run/metrics.jsonl" not in files:
        assert not (tmp_path / "run").exists(), "a refusal must come before anything is written"


# --- a run's saved state, damaged -------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("finished") / "run"
    rc, _, err = run_cli(["train", EXAMPLE, *TINY, "--out", str(run)])
    assert rc == 0, err
    return run


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:64])


DAMAGE = [
    ("state_tensors_truncated", lambda run: truncate(run / "state" / "tensors.safetensors"),
     ["state/tensors.safetensors", "truncated"]),
    ("state_json_bad", lambda run: (run / "state" / "state.json").write_text('{"step": 1, "par'),
     ["state/state.json"]),
    ("state_tensors_missing", lambda run: (run / "state" / "tensors.safetensors").unlink(),
     ["state/tensors.safetensors", "missing"]),
]


@pytest.mark.parametrize("name, damage, needles", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_resume_from_a_damaged_state_names_the_file(tmp_path, finished_run, name, damage, needles):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    damage(run)
    rc, _, err = run_cli(["train", EXAMPLE, *TINY, "--train.steps=2", "--out", str(run), "--resume"])
    assert rc == 2 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


def same_size(path: Path, text: str) -> None:
    """Replace `path` by `text` padded to the old size (so only the content, not the byte count, is wrong)."""
    path.write_text(text.ljust(len(path.read_bytes())))


DAMAGED_RUN_FILES = [
    ("tokenizer_json_a_list", lambda run: same_size(run / "checkpoint" / "tokenizer.json", "[]"),
     ["eval", "{run}"], ["{run}/checkpoint/tokenizer.json", "not a CharTokenizer dict"]),
    ("tokenizer_json_a_list_as_init", lambda run: (run / "checkpoint" / "tokenizer.json").write_text("[]"),
     ["train", EXAMPLE, *TINY, "--model.init={run}/checkpoint", "--out", "{run}/../again"],
     ["model.init", "{run}/checkpoint/tokenizer.json", "not a CharTokenizer dict"]),
    ("price_json_numerics_a_number", lambda run: (run / "price.json").write_text('{"numerics": 5}'),
     ["eval", "{run}"], ["{run}/price.json", "damaged", '"numerics"']),
]


@pytest.mark.parametrize("name, damage, argv, needles", DAMAGED_RUN_FILES, ids=[d[0] for d in DAMAGED_RUN_FILES])
def test_a_damaged_run_file_is_named(tmp_path, finished_run, name, damage, argv, needles):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    damage(run)
    rc, _, err = run_cli([a.replace("{run}", str(run)) for a in argv])
    assert rc == 2 and "Traceback" not in err and err.startswith("rlvr: error: "), err
    for needle in needles:
        assert needle.replace("{run}", str(run)) in err, (needle, err)


def metrics_rows(run: Path) -> list[dict]:
    """Every line of metrics.jsonl parsed (a torn or foreign line fails the test)."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_drops_a_metrics_line_that_is_not_an_object(tmp_path, finished_run):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write("123\n[1, 2]\n")
    rc, _, err = run_cli(["train", EXAMPLE, *TINY, "--train.steps=2", "--out", str(run), "--resume"])
    assert rc == 0, err
    rows = metrics_rows(run)
    assert all(isinstance(r, dict) for r in rows) and {r.get("step") for r in rows} >= {1, 2}
    assert not list(run.glob(".metrics.jsonl.*")), "the rewrite's temporary file is renamed into place"


def test_a_reward_beyond_float32_is_a_named_failure_not_a_crash(tmp_path):
    (tmp_path / "t.py").write_text(
        "from rlvr.rewards import Reward\nfrom rlvr.tasks.sort import sort_task\n\n\ndef make(**kw):\n"
        "    task = sort_task(**kw)\n"
        "    task.rewards['big'] = Reward('big', lambda p, r, a: 1e308, task.rewards['exact'].card)\n"
        "    return task\n")
    out = tmp_path / "run"
    rc, stdout, err = run_cli(train_cli(f"--task.path={tmp_path}/t.py:make", "--task.reward=big")
                              [:-1] + [str(out)])
    assert rc == 0 and "Traceback" not in err, err
    assert "big: returned 1e+308, beyond the float32 range" in stdout, stdout


def test_weighted_rewards_beyond_float32_stop_with_the_weights_named():
    from rlvr.rollout import score_groups
    from rlvr.setup_types import RunError
    from rlvr.tasks.sort import sort_task

    task = sort_task(n=3, heldout=5)
    ex = task.heldout[:1]
    with pytest.raises(RunError, match=r"beyond the float32 range .*position \(weight 1e\+39"):
        score_groups(task, {"position": 1e39}, ex, [ex[0].answer] * 2, 2)


def test_a_chat_template_that_raises_is_a_clear_error(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from tests.hf_models import make_model_dir

    model = make_model_dir(tmp_path / "m", chat=True)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = "{{ raise_exception('this template takes no prompts') }}"
    tok.save_pretrained(model)
    rc, _, err = run_cli(["train", EXAMPLE, *TINY, f"--model.path={model}", "--task.chat=user",
                          "--sampling.max_new_tokens=4", "--out", str(tmp_path / "run")])
    assert rc == 2 and "Traceback" not in err, err
    assert "chat template" in err and "TemplateError" in err and "this template takes no prompts" in err, err
    assert not (tmp_path / "run").exists()


def test_a_signal_during_start_up_stops_the_run_at_once(tmp_path, monkeypatch, capfd):
    """SIGTERM while the run starts (here: while it is priced) exits 143 at once, not after the start-up."""
    import rlvr.trainer

    def slow_price(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
        raise AssertionError("the signal did not stop the start-up")

    monkeypatch.setattr(rlvr.trainer, "price_of", slow_price)
    t0 = time.monotonic()
    rc, out, err = run_cli(train_cli()[:-1] + [str(tmp_path / "run")])
    assert rc == 143 and time.monotonic() - t0 < 30, (rc, err)
    assert "interrupted during start-up" in out, out
    assert "SIGTERM during start-up" in capfd.readouterr().err    # the handler writes to fd 2 itself


def test_a_full_disk_stops_the_run_with_its_state_saved_and_it_resumes(tmp_path, monkeypatch):
    """A metrics write that hits ENOSPC (half a row written, then the error): a clear error naming the
    disk and its free space, no torn row left, the state after that step saved; --resume then finishes."""
    import rlvr.rundir

    real = rlvr.rundir._write
    calls = {"torn": False}

    def full_disk(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
            if calls["torn"]:                       # the disk is full from here on
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if bytes(data[:10]) == b'{"step": 2':   # half of step 2's row fits
                calls["torn"] = True
                return real(fd, data[:len(data) // 2])
        return real(fd, data)

    monkeypatch.setattr(rlvr.rundir, "_write", full_disk)
    run = tmp_path / "run"
    argv = ["train", EXAMPLE, *TINY, "--train.steps=3", "--out", str(run)]
    rc, _, err = run_cli(argv)
    assert rc == 2 and "Traceback" not in err, err
    for needle in (f"cannot write {run}/metrics.jsonl", "No space left on device", "MiB free", "mounted at",
                   "the state after step 2 was saved", "--resume"):
        assert needle in err, (needle, err)
    assert [r["step"] for r in metrics_rows(run) if "train/reward" in r] == [1]   # no torn row
    monkeypatch.setattr(rlvr.rundir, "_write", real)
    rc, _, err = run_cli(argv + ["--resume"])
    assert rc == 0, err
    assert [r["step"] for r in metrics_rows(run) if "train/reward" in r] == [1, 3]
    assert json.loads((run / "summary.json").read_text())["steps"] == 3


# --- rows the run's build checks up front against the loaded task (rlvr.config.check_against_task) --

NEEDS_TRAINER = [
    ("more_prompts_per_step_than_prompts", {}, train_cli("--train.prompts_per_step=1000000"), 2,
     ["train.prompts_per_step", "(command line)", "training prompts"]),
]


@pytest.mark.parametrize("name, files, argv, code, needles", NEEDS_TRAINER, ids=[r[0] for r in NEEDS_TRAINER])
def test_bad_input_the_trainer_must_check(tmp_path, name, files, argv, code, needles):
    test_bad_input_is_refused_before_compute(tmp_path, name, files, argv, code, needles)


def test_prompts_per_step_and_context_checked_against_the_task():
    from rlvr import config
    from rlvr.config import ConfigError

    cfg = config.load(EXAMPLE, ["--train.prompts_per_step=5000"])
    with pytest.raises(ConfigError, match=r"train\.prompts_per_step: 5000 exceeds the task's 300 .*command line"):
        config.check_against_task(cfg, train_prompts=300, prompt_tokens=10, max_new_tokens=5)
    cfg = config.load(EXAMPLE, ["--train.prompts_per_step=4"])
    with pytest.raises(ConfigError, match=r"task\.options: .*\(10000000 tokens\) \+ max_new_tokens \(5\).*8192.*sort\.toml:7"):
        config.check_against_task(cfg, train_prompts=300, prompt_tokens=10_000_000, max_new_tokens=5)
    config.check_against_task(cfg, train_prompts=300, prompt_tokens=10, max_new_tokens=5)


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("POSIX paths in messages")
