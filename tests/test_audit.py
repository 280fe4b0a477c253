"""`rlvr audit`: strategies that do not solve the task, scored against a solved response.

Small on purpose (2 shared cores): the sort task is loaded with few held-out prompts, and the
hand-checked rows use a two-example task built here.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlvr import audit
from rlvr.cli import main
from rlvr.tasks import Example, Task
from rlvr.tasks.sort import sort_task

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "sort.toml")
SMALL = ["--task.options={n = 5, heldout = 200}", "--prompts", "100"]
TINY = ["--task.options={n = 4, heldout = 50}", "--prompts", "50"]


@pytest.fixture(scope="module")
def sort5() -> Task:
    return sort_task(n=5, heldout=100)


def audit_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["audit", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _rows(result) -> dict:
    return {r.name: r for r in result.rows}


# --- the sort task: the requirements ------------------------------------------------

def test_inclusion_adjacency_is_flagged_and_names_the_strategies(capsys):
    code, out, err = audit_cli(capsys, EXAMPLE, "--task.reward=inclusion_adjacency", *SMALL)
    assert code == 1, err
    assert "known exploit:" in out and "pays for:" in out and "ignores:" in out
    flagged = [line.split()[0] for line in out.splitlines() if line.endswith("FLAGGED")]
    # the card's near-sort, copying the prompt (the card's second exploit) and one changed digit
    for name in ("exploit:inclusion_adjacency", "copy_prompt", "one_char_off", "repeat_answer_char"):
        assert name in flagged, out
    assert "random" not in flagged
    assert out.rstrip().splitlines()[-1].startswith(f"FLAGGED {len(flagged)} of ")


def test_exact_is_clean(capsys):
    code, out, err = audit_cli(capsys, EXAMPLE, "--task.reward=exact", *TINY)
    assert code == 0, err
    assert "FLAGGED" not in out and out.rstrip().endswith("without meeting the goal")
    assert "exploit_example: none" in out  # exact has no exploit, so no exploit: row
    assert "exploit:exact" not in out


def test_position_pays_partial_credit(sort5):
    task = sort5
    res = audit.run_audit(task, {"position": 1.0}, prompts=100, threshold=0.5, seed=0)
    rows = _rows(res)
    assert rows["one_char_off"].mean_reward == pytest.approx(0.8)  # 4 of 5 positions, always
    assert rows["corrupt_half"].mean_reward == pytest.approx(0.4)  # 3 of 5 changed
    assert res.flagged == ["one_char_off"]
    # fixed-length task: truncating the gold answer + padding gives the gold back
    assert rows["pad_candidates"].scored == 0 and rows["pad_candidates"].not_applicable == 100


# --- hand-checked scores ---------------------------------------------------------------------

def _two_example_task() -> Task:
    base = sort_task(n=2, heldout=1)  # its reward functions work on any length
    return Task(name="two", train=[Example("55555=", "55555"), Example("12345=", "12345"), Example("54321=", "12345")],
                heldout=[Example("31415=", "11345"), Example("90210=", "00129")],
                rewards=base.rewards, goal=base.goal, max_new_tokens=5, alphabet=base.alphabet,
                fixed_length=True)


def test_copy_prompt_scores_by_hand():
    task = _two_example_task()
    strategies = {"copy_prompt": audit.copy_prompt, "constant_answer": audit.constant_answer}
    res = audit.run_audit(task, {"inclusion_adjacency": 1.0}, prompts=2, threshold=0.5, seed=0,
                          strategies=strategies)
    rows = _rows(res)
    # "31415" vs 11345: inclusion 5, pairs 1<=4 and 1<=5 → 7/9.
    # "90210" vs 00129: inclusion 5, pair 0<=2 → 6/9.
    assert rows["copy_prompt"].example == "31415"
    assert rows["copy_prompt"].mean_reward == pytest.approx((7 / 9 + 6 / 9) / 2)
    # most frequent training answer is "12345": vs 11345 inclusion 1,3,4,5 = 4; vs 00129 {1,2} = 2; 4 pairs each
    assert rows["constant_answer"].example == "12345"
    assert rows["constant_answer"].mean_reward == pytest.approx((8 / 9 + 6 / 9) / 2)
    assert res.solved_reward == 1.0 and res.flagged == ["exploit:inclusion_adjacency", "copy_prompt",
                                                         "constant_answer"]

    res = audit.run_audit(task, {"position": 1.0}, prompts=2, threshold=0.5, seed=0, strategies=strategies)
    # 31415 vs 11345: positions 2 and 5 → 2/5; 90210 vs 00129: position 2 → 1/5
    assert _rows(res)["copy_prompt"].mean_reward == pytest.approx(0.3)
    assert not _rows(res)["copy_prompt"].flagged

    # a weighted sum scores as the trainer does: 0.5 × position + 2 × inclusion_adjacency
    res = audit.run_audit(task, {"position": 0.5, "inclusion_adjacency": 2.0}, prompts=2, threshold=0.5,
                          seed=0, strategies=strategies)
    row = _rows(res)["copy_prompt"]
    assert res.solved_reward == pytest.approx(2.5)
    assert row.mean_reward == pytest.approx(0.5 * 0.3 + 2 * 13 / 18)
    assert row.per_reward == pytest.approx({"position": 0.3, "inclusion_adjacency": 13 / 18})
    assert [r.name for r in res.rows][:2] == ["exploit:position", "exploit:inclusion_adjacency"]


def test_accidental_hits_are_reported_but_do_not_hide_the_exploit():
    task = _two_example_task()
    task.heldout = [Example("12345=", "12345"), Example("90210=", "00129")]
    task.train = [Example("55555=", "55555")]
    res = audit.run_audit(task, {"inclusion_adjacency": 1.0}, prompts=2, threshold=0.5, seed=0,
                          strategies={"copy_prompt": audit.copy_prompt})
    row = _rows(res)["copy_prompt"]
    assert row.goal_rate == 0.5  # the first prompt is already sorted: copying it solves it
    assert row.mean_reward == pytest.approx((1 + 6 / 9) / 2)
    assert row.miss_reward == pytest.approx(6 / 9)  # the flag is judged on the miss alone
    assert row.flagged


def test_partial_solutions_never_equal_the_answer_and_are_realisable(sort5):
    task = sort5
    ctx = audit._context(task, task.max_new_tokens)
    rng = random.Random(0)
    for ex in task.heldout:
        for fn, changed in ((audit.one_char_off, 1), (audit.corrupt_half, 3)):
            r = fn(ex, task, rng, ctx)
            assert len(r) == 5 and sum(a != b for a, b in zip(r, ex.answer)) == changed
        assert len(audit.random_chars(ex, task, rng, ctx)) == 5
    assert audit.copy_prompt(task.heldout[0], task, rng, ctx) == task.heldout[0].prompt  # run_audit truncates


# --- a planted exploit in a task file --------------------------------------------------------

PLANTED = '''
from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Example, Task

def seven(prompt, response, answer):
    return 1.0 if response == answer or response.startswith("7") else 0.0

def make(card=True):
    ex = [Example(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
    c = RewardCard(pays_for="the sum, or anything starting with 7", ignores="everything after a leading 7",
                   exploit="answer 7: scores 1.0 on every prompt", exploit_example=lambda e: "7")
    r = Reward("seven", seven, c if card else None)
    return Task(name="add", train=ex[:80], heldout=ex[80:], rewards={"seven": r},
                goal=lambda p, r, a: r == a, max_new_tokens=3)
'''


@pytest.fixture
def planted(tmp_path) -> str:
    f = tmp_path / "planted.py"
    f.write_text(textwrap.dedent(PLANTED))
    return str(f)


def test_planted_exploit_is_flagged(capsys, planted):
    code, out, err = audit_cli(capsys, EXAMPLE, f"--task.path={planted}:make", "--task.reward=seven",
                               "--task.options={}")
    assert code == 1, err
    line = next(x for x in out.splitlines() if x.startswith("exploit:seven"))
    assert line.split()[1:5] == ["1.000", "0.0%", "1.000", "1.000"] and line.endswith("FLAGGED")
    assert "20 held-out prompts" in out and "asked for 200 prompts" in out
    # free-length task: padding the gold answer with candidates is applicable here
    pad = next(x for x in out.splitlines() if x.startswith("pad_candidates"))
    assert "not applicable on any" not in out and pad.split()[5] == "20"


def test_task_without_a_card_is_exit_2(capsys, planted):
    code, out, err = audit_cli(capsys, EXAMPLE, f"--task.path={planted}:make", "--task.reward=seven",
                               "--task.options={card = false}")
    assert code == 2 and out == ""
    assert err.startswith("rlvr: error: ") and "has no RewardCard" in err and "breaks the contract" in err


def test_broken_exploit_example_is_a_row_error_not_a_crash():
    task = _two_example_task()
    task.rewards["exact"].card.exploit_example = lambda ex: 1 / 0
    try:
        res = audit.run_audit(task, {"exact": 1.0}, prompts=2, threshold=0.5, seed=0, strategies={})
    finally:
        task.rewards["exact"].card.exploit_example = None
    assert res.rows[0].error.startswith("ZeroDivisionError") and not res.flagged
    assert "ERROR: ZeroDivisionError" in audit.format_audit(res)


# --- JSON and bad input ------------------------------------------------------------------------

def test_json_output(capsys):
    code, out, _ = audit_cli(capsys, EXAMPLE, "--task.reward=inclusion_adjacency", "--json", *TINY)
    data = json.loads(out)
    assert code == 1 and data["flagged"] and data["prompts"] == 50 and data["threshold"] == 0.5
    assert data["weights"] == {"inclusion_adjacency": 1.0} and data["solved_reward"] == 1.0
    assert set(data["cards"]["inclusion_adjacency"]) == {"pays_for", "ignores", "exploit", "exploit_example"}
    rows = {r["name"]: r for r in data["rows"]}
    assert set(audit.STRATEGIES) | {"exploit:inclusion_adjacency"} == set(rows)
    assert rows["exploit:inclusion_adjacency"]["fraction"] == pytest.approx(6 / 7)  # n=4: 6 of 7 points
    assert all(rows[n]["flagged"] == (n in data["flagged"]) for n in rows)


@pytest.mark.parametrize("argv, message", [
    (["--threshold", "0"], "--threshold must be in (0, 1]"),
    (["--threshold", "1.5"], "--threshold must be in (0, 1]"),
    (["--threshold", "nan"], "--threshold must be in (0, 1]"),
    (["--prompts", "0"], "--prompts must be at least 1"),
    (["--task.reward=nope", "--task.options={n = 3, heldout = 10}"], "task.reward: task 'sort-3' has no reward 'nope'"),
    (["--task.path=nowhere.py:make"], "file does not exist"),
    (["--task.options={n = 1}"], "n must be at least 2"),
    (["--train.stepz=3"], "unknown key train.stepz"),
])
def test_bad_input_is_exit_2(capsys, argv, message):
    code, out, err = audit_cli(capsys, EXAMPLE, *argv)
    assert code == 2 and out == "" and err.startswith("rlvr: error: ") and message in err, err


def test_missing_config_is_exit_2(capsys, tmp_path):
    code, _, err = audit_cli(capsys, str(tmp_path / "none.toml"))
    assert code == 2 and "does not exist" in err


def test_run_audit_rejects_bad_arguments():
    task = _two_example_task()
    with pytest.raises(ValueError, match="threshold"):
        audit.run_audit(task, {"exact": 1.0}, prompts=2, threshold=0, seed=0)
    with pytest.raises(ValueError, match="prompts"):
        audit.run_audit(task, {"exact": 1.0}, prompts=0, threshold=0.5, seed=0)


def test_audit_does_not_import_torch():
    code = "import sys, rlvr.audit; sys.exit('torch' in sys.modules or 'rlvr.trainer' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
