"""rlvr.tasks.rgym: reasoning-gym datasets by name, the wrapped scorer, statuses and the card."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym")

from rlvr.rewards import score, score_batch  # noqa: E402
from rlvr.tasks import TaskError, load_task, weighted_rewards  # noqa: E402
from rlvr.tasks.rgym import dataset_names, extract_answer, rgym_task  # noqa: E402


@pytest.fixture(scope="module")
def legs():
    return load_task("rlvr.tasks.rgym:rgym_task", name="leg_counting", size=30, heldout=5, seed=0)


def test_task_shape_and_gold(legs):
    assert legs.name == "rgym-leg_counting" and len(legs.heldout) == 5 and len(legs.train) >= 25
    assert not {e.prompt for e in legs.train} & {e.prompt for e in legs.heldout}
    assert legs.alphabet is None and legs.fixed_length is False
    ex = legs.heldout[0]
    assert ex.prompt.endswith("<answer></answer>.") and "metadata" in ex.answer.meta
    gold = str(ex.answer)
    for resp in (f"<answer>{gold}</answer>", f"reasoning\n<answer> {gold} </answer>", f"so\n{gold}\n"):
        assert score(legs.rewards["score"], ex.prompt, resp, ex.answer) == (1.0, "ok", "")
        assert legs.goal(ex.prompt, resp, ex.answer)
    assert score(legs.rewards["solved"], ex.prompt, "<answer>1</answer>", ex.answer).value == 0.0
    again = rgym_task(name="leg_counting", size=30, heldout=5, seed=0, probe=0)
    assert [e.prompt for e in again.heldout] == [e.prompt for e in legs.heldout]


def test_default_scorer_pays_for_a_wrong_answer_containing_the_gold(legs):
    ex = legs.heldout[0]
    gold = str(ex.answer)
    wrong = f"<answer>{gold}0</answer>"  # a different number
    v = score(legs.rewards["score"], ex.prompt, wrong, ex.answer).value
    assert v == pytest.approx(len(gold) / (len(gold) + 1)) and v > 0.5
    assert score(legs.rewards["solved"], ex.prompt, wrong, ex.answer).value == 0.0
    card = legs.rewards["score"].card
    assert "default scorer" in card.exploit and "'GOLD0' scores 0." in card.exploit
    made = card.exploit_example(ex)
    assert 0 < score(legs.rewards["score"], ex.prompt, made, ex.answer).value < 1


def test_lenient_scorer_pays_any_string():
    task = rgym_task(name="game_of_life_halting", size=6, heldout=2, probe=6)
    ex = task.heldout[0]
    assert score(task.rewards["score"], ex.prompt, "<answer>x</answer>", ex.answer).value == 1.0
    assert "'x' scores 1.00" in task.rewards["score"].card.exploit
    assert task.rewards["solved"].card.exploit_example is not None


def test_scorer_exception_is_counted_not_silent():
    task = rgym_task(name="prime_factorization", size=6, heldout=2, probe=0)
    ex = task.heldout[0]
    b = score_batch(weighted_rewards(task, {"score": 1.0}), [ex.prompt] * 2,
                    ["<answer>x</answer>", f"<answer>{ex.answer}</answer>"], [ex.answer] * 2)
    assert b.status_counts["error"] == 1 and b.per_reward["score"][1] == 1.0
    assert "ValueError" in b.errors[0]
    assert score(task.rewards["solved"], ex.prompt, "<answer>x</answer>", ex.answer).status == "error"
    assert not task.goal(ex.prompt, "<answer>x</answer>", ex.answer)


def test_unknown_name_lists_close_matches():
    with pytest.raises(TaskError, match=r"unknown reasoning-gym dataset 'leg_count'; did you mean leg_counting"):
        rgym_task(name="leg_count")
    with pytest.raises(TaskError, match="no close match"):
        rgym_task(name="zzzzqqq")
    assert "leg_counting" in dataset_names()


@pytest.mark.parametrize("resp,mode,want", [
    ("a <answer> 5 </answer> b <answer>6</answer>", "auto", "6"),
    ("line1\n  42  \n\n", "auto", "42"),
    ("line1\n42", "tags", None),
    ("", "auto", None),
    ("  raw text ", "raw", "raw text"),
])
def test_extract(resp, mode, want):
    assert extract_answer(resp, mode) == want


def test_example_config_trains_two_steps(tmp_path):
    import io
    import json
    from contextlib import redirect_stderr, redirect_stdout
    from pathlib import Path

    from rlvr.cli import main

    cfg = Path(__file__).resolve().parent / "configs" / "rgym.toml"
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["train", str(cfg), "--out", str(tmp_path / "run"), "--model.n_embd=32", "--model.n_layer=1",
                   "--model.n_head=2", "--train.steps=2", "--train.prompts_per_step=4",
                   "--train.samples_per_prompt=4", "--eval.every=0", "--eval.prompts=5", "--eval.pass_k=0",
                   '--task.options={name = "leg_counting", size = 20, heldout = 5, max_new_tokens = 8, probe = 5}'])
    assert rc == 0, err.getvalue()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval/reward_failures"] == 0
