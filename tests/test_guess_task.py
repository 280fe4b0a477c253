"""rlvr.tasks.guess: the guessing game's secrets, referee and rewards by hand, and a short multi-turn run."""

from __future__ import annotations

import io
import json
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout

import pytest

from rlvr.tasks import load_task
from rlvr.tasks.guess import guess_task, guessed, last_guess, make_referee, secret


def test_secrets_are_in_range_spread_and_fixed_by_key_and_seed():
    vals = [secret(k, 1, 100, 0) for k in range(1000, 10000)]
    assert min(vals) == 1 and max(vals) == 100
    assert max(Counter(vals).values()) < 3 * len(vals) / 100                 # no value dominates
    assert sum(secret(k, 0, 9, 0) != secret(k, 0, 9, 1) for k in range(1000, 1100)) > 50   # the seed changes them


def test_the_referee_answers_the_last_guess():
    chat, compact = make_referee("chat"), make_referee("compact")
    assert last_guess("I guess 50\nuser\nlower\nassistant\n25") == 25 and last_guess("no idea") is None
    assert chat("", "50", 42) == "lower" and chat("", "50\nlower\n30", 42) == "higher"
    assert chat("", "50 lower 42", 42) is None and chat("", "hmm", 42) == "Reply with a number."
    assert compact("", "5<3", 4) == ">" and compact("", "5", 4) == "<" and compact("", "4", 4) is None
    assert guessed("", "50 lower 42", 42) == 1.0 and guessed("", "42 then 43", 42) == 0.0


def test_the_task_loads_with_disjoint_games_in_both_styles():
    task = load_task("rlvr.tasks.guess:guess_task", heldout=20, train=100)
    assert task.environment is not None and task.tool is None and "game" in task.train[0].prompt
    assert task.train[0].meta["messages"][0]["content"] == task.train[0].prompt
    assert not {e.prompt for e in task.train} & {e.prompt for e in task.heldout}
    compact = guess_task(low=0, high=9, heldout=5, train=10, style="compact")
    assert compact.train[0].prompt.endswith("?") and compact.max_new_tokens == 16
    with pytest.raises(ValueError, match="style"):
        guess_task(style="loud")
    with pytest.raises(ValueError, match="low < high"):
        guess_task(low=5, high=5)


def test_a_multi_turn_run_plays_games(tmp_path):
    from rlvr.cli import main

    config = tmp_path / "guess.toml"
    config.write_text('[task]\npath = "rlvr.tasks.guess:guess_task"\nreward = "guessed"\nreward_workers = 0\n'
                      'options = { low = 0, high = 9, style = "compact", heldout = 20, train = 200 }\n'
                      '[sampling]\nmax_tool_calls = 3\ntool_on_end = true\n'
                      '[model]\nn_layer = 1\nn_embd = 32\nn_head = 2\n'
                      '[train]\nsteps = 2\nprompts_per_step = 4\nsamples_per_prompt = 4\n'
                      '[eval]\nevery = 0\npass_k = 0\n[log]\nrollouts_per_step = 4\n')
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["train", str(config), "--out", str(tmp_path / "run")])
    assert rc == 0, err.getvalue()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("train/tool_calls_per_response", 0) for r in rows) > 0
    responses = [x for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()
                 for x in json.loads(line)["responses"]]
    assert any("<" in x or ">" in x for x in responses)                    # the environment's turns are there
