"""rlvr.tasks.dataset: JSONL tasks, the meta convention, reward paths, and errors before compute."""

from __future__ import annotations

import json

import pytest

from rlvr.rewards import score, score_batch
from rlvr.tasks import TaskError, load_task, weighted_rewards
from rlvr.tasks.dataset import Answer, jsonl_task

PATH = "rlvr.tasks.dataset:jsonl_task"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"prompt": f"q{i}", "answer": str(i), "level": i % 3, "alt": f"a{i}"} for i in range(20)]

REWARDS_PY = '''
def uses_meta(prompt, response, answer, meta):
    return 1.0 if response == meta["alt"] else 0.0

def plain(prompt, response, answer):
    return 1.0 if response == answer else 0.0

def kwargs_too(prompt, response, answer, **kw):
    return float(kw["meta"]["level"])
'''


def test_jsonl_task_loads_with_meta_and_split(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    task = load_task(PATH, train=train, heldout_fraction=0.25, seed=1)
    assert len(task.train) == 15 and len(task.heldout) == 5
    assert not {e.prompt for e in task.train} & {e.prompt for e in task.heldout}
    ex = task.train[0]
    assert isinstance(ex.answer, Answer) and str(ex.answer) == ex.answer.value
    assert ex.answer.meta == {"level": int(ex.answer.value) % 3, "alt": "a" + ex.answer.value}
    assert ex.meta["source"].endswith(".jsonl:" + str(int(ex.answer.value) + 1))
    assert task.alphabet is None and task.fixed_length is False and task.max_new_tokens == 64
    assert score(task.rewards["exact_match"], ex.prompt, f" {ex.answer} ", ex.answer) == (1.0, "ok", "")
    assert task.goal(ex.prompt, str(ex.answer), ex.answer) and not task.goal(ex.prompt, "no", ex.answer)
    again = load_task(PATH, train=train, heldout_fraction=0.25, seed=1)
    assert [e.prompt for e in again.heldout] == [e.prompt for e in task.heldout]


def test_rewards_from_file_get_meta_only_when_they_ask(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    rw = tmp_path / "rw.py"
    rw.write_text(REWARDS_PY)
    task = jsonl_task(train, rewards=[f"{rw}:uses_meta", f"{rw}:plain", f"{rw}:kwargs_too", "exact_match"])
    assert list(task.rewards) == ["uses_meta", "plain", "kwargs_too", "exact_match"]
    ex = task.train[0]
    assert task.rewards["uses_meta"](ex.prompt, ex.answer.meta["alt"], ex.answer) == 1.0
    assert task.rewards["plain"](ex.prompt, ex.answer.value, ex.answer) == 1.0  # value, not the Answer
    assert task.rewards["kwargs_too"](ex.prompt, "x", ex.answer) == float(ex.answer.meta["level"])
    assert "not audited" in task.rewards["plain"].card.exploit
    # the goal defaults to the first reward reaching 1.0
    assert task.goal(ex.prompt, ex.answer.meta["alt"], ex.answer)


def test_weighted_dict_and_trainer_weights(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    rw = tmp_path / "rw.py"
    rw.write_text(REWARDS_PY)
    task = jsonl_task(train, rewards={"m": {"path": f"{rw}:uses_meta", "weight": 0.5},
                                      "em": {"path": "exact_match", "weight": 2}})
    assert set(task.rewards) == {"m", "em", "weighted"}
    ex = task.train[0]
    assert task.rewards["weighted"](ex.prompt, ex.answer.value, ex.answer) == 2.0
    b = score_batch(weighted_rewards(task, {"m": 1.0, "em": 1.0}), [ex.prompt] * 2,
                    [ex.answer.value, ex.answer.meta["alt"]], [ex.answer] * 2)
    assert b.total == [1.0, 1.0] and b.failed == 0
    with pytest.raises(TaskError, match="reward_weights"):
        jsonl_task(train, rewards={"em": 1.0})


def test_answer_column_none_passes_the_row(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", ROWS)
    task = jsonl_task(train, answer_column=None, goal="exact_match")
    ex = task.heldout[0]
    assert isinstance(ex.answer.value, dict) and set(ex.answer.value) == {"answer", "level", "alt"}


def test_separate_heldout_file_and_overlap(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[:15])
    held = write_jsonl(tmp_path / "held.jsonl", ROWS[15:])
    task = jsonl_task(train, held)
    assert len(task.train) == 15 and len(task.heldout) == 5
    bad = write_jsonl(tmp_path / "bad.jsonl", ROWS[10:])
    with pytest.raises(TaskError, match=r"overlaps train.*5 prompt\(s\) in both"):
        jsonl_task(train, bad)


def test_errors_name_file_line_and_columns(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", answer: 2}\n')
    with pytest.raises(TaskError, match=r"x\.jsonl:3: not valid JSON"):
        jsonl_task(str(p))
    p.write_text('{"prompt": "a", "answer": "1"}\n[1, 2]\n')
    with pytest.raises(TaskError, match=r"x\.jsonl:2: expected a JSON object"):
        jsonl_task(str(p))
    p.write_text('{"question": "a", "answer": "1"}\n')
    with pytest.raises(TaskError, match=r"x\.jsonl:1: no prompt column 'prompt'; the row has: question, answer"):
        jsonl_task(str(p))
    with pytest.raises(TaskError, match=r"no answer column 'solution'; the row has: question, answer"):
        jsonl_task(str(p), prompt_column="question", answer_column="solution")
    p.write_text("\n  \n")
    with pytest.raises(TaskError, match="empty file"):
        jsonl_task(str(p))
    with pytest.raises(TaskError, match="does not exist"):
        jsonl_task(str(tmp_path / "missing.jsonl"))


def test_reward_path_errors_come_before_reading(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(TaskError, match=r"no_such_pkg.*failed to import: ModuleNotFoundError"):
        jsonl_task(train, rewards="no_such_pkg.mod:fn")
    broken = tmp_path / "broken.py"
    broken.write_text("import nope_not_here\n")
    with pytest.raises(TaskError, match=r"broken\.py failed to import: ModuleNotFoundError"):
        jsonl_task(train, rewards=f"{broken}:fn")
    rw = tmp_path / "rw.py"
    rw.write_text(REWARDS_PY)
    with pytest.raises(TaskError, match=r"has no 'missing'; callables there: kwargs_too, plain, uses_meta"):
        jsonl_task(train, rewards=f"{rw}:missing")
    with pytest.raises(TaskError, match="not a built-in"):
        jsonl_task(train, rewards="exact")
    # through load_task the message keeps the task path
    with pytest.raises(TaskError, match=r"rlvr\.tasks\.dataset:jsonl_task: calling"):
        load_task(PATH, train=train, rewards="no_such_pkg.mod:fn")


def test_csv_through_datasets(tmp_path):
    pytest.importorskip("datasets")
    p = tmp_path / "d.csv"
    p.write_text("prompt,answer,src\nq1,1,a\nq2,2,b\nq3,3,c\n")
    task = jsonl_task(str(p), heldout_fraction=0.34)
    assert len(task.train) + len(task.heldout) == 3
    ex = task.train[0]
    assert set(ex.answer.meta) == {"src"} and ex.meta["source"].startswith(str(p))
