"""rlvr.tasks.countdown: the ast verifier (never eval), extraction, rewards, the task, a 2-step run."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from rlvr.rewards import score
from rlvr.tasks import load_task
from rlvr.tasks.countdown import check, countdown_task, extract_expression, verify
from rlvr.tasks.dataset import Answer, jsonl_task

EXAMPLE = Path(__file__).resolve().parent / "configs" / "countdown.toml"


@pytest.mark.parametrize("expr", ["(25-5)*4", "4*(25-5)", " ( 25 - 5 ) * 4 ", "((25-5))*4", "4 * (25 - 5)"])
def test_accepts_solutions(expr):
    assert verify(expr, [25, 5, 4], 80)


def test_exact_rational_division():
    assert verify("(7-1)/4*2", [7, 1, 4, 2], 3)
    assert verify("6/4*2", [6, 4, 2], 3)  # 1.5 * 2, exact
    assert not verify("7/2", [7, 2], 3)


@pytest.mark.parametrize("expr,why", [
    ("__import__('os')", "characters not allowed"),
    ("2**10", "Pow is not allowed"),
    ("a+b", "characters not allowed"),
    ("25+25+5+4", "beyond the given numbers"),   # 25 used twice
    ("(25-5)*4+4", "beyond the given numbers"),
    ("25-5", "does not use [4]"),              # exactly once: 4 missing
    ("25/(5-5)*4", "division by zero"),
    ("-5+25*4", "unary operators"),
    ("25*(-(5-4))", "unary operators"),
    ("+25-5*4", "unary operators"),
    ("2_5*4-5", "characters not allowed"),      # 2_5 would parse as 25
    ("25.0-5*4", "characters not allowed"),
    ("25//5*4", "FloorDiv is not allowed"),
    ("25%5+4", "characters not allowed"),
    ("(25-5)*4)", "not an allowed expression"),
    ("", "empty expression"),
    ("1" * 300, "longer than"),
])
def test_rejects(expr, why):
    v = check(expr, [25, 5, 4], 80)
    assert not v.correct and why in v.reason


def test_at_most_once_mode():
    assert not verify("25*4-20", [25, 5, 4, 20, 3], 80)
    assert verify("25*4-20", [25, 5, 4, 20, 3], 80, use_all=False)
    assert not verify("25*4-20-5+5", [25, 5, 4, 20], 80, use_all=False)  # 5 twice


def test_deep_nesting_is_invalid_not_a_crash():
    assert check("(" * 90 + "1" + ")" * 90, [1], 1).correct  # 181 characters: parsed and evaluated
    assert check("(" * 150 + "1" + ")" * 150, [1], 1).reason.startswith("longer than")


@pytest.mark.parametrize("response,expr", [
    ("(25-5)*4", "(25-5)*4"),
    ("think...\n<answer> (25-5)*4 </answer>", "(25-5)*4"),
    ("<answer>1+1</answer> then <answer>(25-5)*4</answer>", "(25-5)*4"),
    ("(25-5)*4 = 80", "(25-5)*4"),
    ("80 = (25-5)*4", "(25-5)*4"),
    ("first try 1+2\n\n(25-5)*4\n", "(25-5)*4"),
    ("", ""),
])
def test_extract(response, expr):
    assert extract_expression(response) == expr


def test_task_rewards_and_cards():
    task = load_task("rlvr.tasks.countdown:countdown_task", train=300, heldout=40, seed=3)
    again = countdown_task(train=300, heldout=40, seed=3)
    assert [e.prompt for e in task.heldout] == [e.prompt for e in again.heldout]
    assert not {e.prompt for e in task.train} & {e.prompt for e in task.heldout}
    assert task.alphabet and task.fixed_length is False
    for ex in task.train[:100] + task.heldout:
        m = ex.answer.meta
        assert 1 <= m["target"] <= 100 and len(m["numbers"]) == 3
        assert verify(str(ex.answer), m["numbers"], m["target"])  # solvable: str(answer) is a solution
        assert task.goal(ex.prompt, str(ex.answer), ex.answer)
    ex = task.heldout[0]
    c, f = task.rewards["correct"], task.rewards["format"]
    assert score(c, ex.prompt, str(ex.answer), ex.answer).value == 1.0
    assert score(f, ex.prompt, str(ex.answer), ex.answer).value == 1.0
    exploit = f.card.exploit_example(ex)
    assert score(f, ex.prompt, exploit, ex.answer).value == 1.0
    assert score(c, ex.prompt, exploit, ex.answer).value == 0.0 and not task.goal(ex.prompt, exploit, ex.answer)
    assert score(f, ex.prompt, "7", ex.answer).value == 0.5  # allowed syntax, wrong numbers
    assert score(f, ex.prompt, "hello", ex.answer).value == 0.0
    inst = countdown_task(train=20, heldout=5, style="instruct")
    assert inst.alphabet is None and "<answer>" in inst.heldout[0].prompt


def test_rewards_in_a_dataset_task(tmp_path):
    rows = [{"prompt": f"Make {t} from {n}", "target": t, "nums": n} for t, n in
            [(80, [25, 5, 4]), (24, [4, 6, 1]), (10, [2, 5, 9]), (7, [3, 4, 2])]]
    p = tmp_path / "cd.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = jsonl_task(str(p), answer_column=None, heldout_fraction=0.25,
                      rewards=["rlvr.tasks.countdown:correct", "rlvr.tasks.countdown:format_reward"])
    ans = next(e.answer for e in task.train + task.heldout if e.answer.value["target"] == 80)
    assert task.rewards["correct"]("", "<answer>(25-5)*4</answer>", ans) == 1.0
    assert task.rewards["format_reward"]("", "25+5+4", ans) == 1.0
    assert score(task.rewards["correct"], "", "1", Answer("x", {})).status == "error"  # no instance: counted


def test_example_config_trains_two_steps(tmp_path):
    from rlvr.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["train", str(EXAMPLE), "--out", str(tmp_path / "run"), "--model.n_embd=32", "--model.n_layer=1",
                   "--model.n_head=2", "--train.steps=2", "--train.prompts_per_step=4",
                   "--train.samples_per_prompt=4", "--eval.every=0", "--eval.prompts=10", "--eval.pass_k=0",
                   "--task.options={train = 100, heldout = 10}"])
    assert rc == 0, err.getvalue()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval/reward_failures"] == 0
