"""rlvr.tasks.mix: several task families trained as one, each scored by its own reward and goal."""

from __future__ import annotations

import io
import json
import pickle
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout

import pytest

from rlvr import cli
from rlvr.rewards import score_batch
from rlvr.tasks import TaskError, load_task, validate_task, weighted_rewards
from rlvr.tasks.mix import MixAnswer, mix_task

ADD = {"path": "rlvr.tasks.arith:arith_task", "options": {"ops": "+", "digits": 1, "heldout": 10},
       "reward": "correct"}
MUL = {"path": "rlvr.tasks.arith:arith_task", "options": {"ops": "*", "digits": 1, "heldout": 8},
       "reward": "correct", "name": "times"}


def test_each_example_is_scored_by_its_own_component():
    task = mix_task([ADD, {**MUL, "weight": 3}])
    validate_task(task)
    assert task.name == "mix(arith-add-1d, times)" and list(task.rewards) == ["mixed"]
    add, mul = load_task(ADD["path"], **ADD["options"]), load_task(MUL["path"], **MUL["options"])
    assert [ex.meta["task"] for ex in task.heldout] == ["arith-add-1d"] * 10 + ["times"] * 8
    assert [ex.prompt for ex in task.heldout] == [ex.prompt for ex in add.heldout + mul.heldout]
    for ex in task.heldout:
        own = (add if ex.meta["task"] == "arith-add-1d" else mul).heldout
        truth = next(e.answer for e in own if e.prompt == ex.prompt)
        assert ex.answer == MixAnswer(0 if ex.meta["task"] == "arith-add-1d" else 1, truth) and str(ex.answer) == str(truth)
        assert task.goal(ex.prompt, f"It is {truth}.", ex.answer)
        assert task.rewards["mixed"](ex.prompt, f"It is {truth}.", ex.answer) == 1.0
        assert task.rewards["mixed"](ex.prompt, "It is 1000.", ex.answer) == 0.0
    assert pickle.loads(pickle.dumps(task.heldout[0].answer)) == task.heldout[0].answer   # reward workers


def test_training_prompts_come_in_proportion_to_the_weights():
    task = mix_task([ADD, {**MUL, "weight": 3}])
    add, mul = load_task(ADD["path"], **ADD["options"]), load_task(MUL["path"], **MUL["options"])
    n = len(add.train) + len(mul.train)
    counts = Counter(ex.meta["task"] for ex in task.train)
    assert counts == {"arith-add-1d": round(n / 4), "times": round(3 * n / 4)}
    # the smaller set is cycled through to fill its share: every example of it appears
    assert {ex.prompt for ex in task.train if ex.meta["task"] == "times"} == {ex.prompt for ex in mul.train}
    assert [ex.prompt for ex in mix_task([ADD, {**MUL, "weight": 3}]).train] == [ex.prompt for ex in task.train]


def test_a_mixture_scores_in_reward_workers_as_in_process():
    from rlvr.reward_pool import RewardPool

    opts = {"tasks": [ADD, MUL]}
    task = load_task("rlvr.tasks.mix:mix_task", **opts)
    exs = task.heldout
    prompts, answers = [e.prompt for e in exs], [e.answer for e in exs]
    responses = [f"{e.answer}" if i % 2 else "no" for i, e in enumerate(exs)]
    here = score_batch(weighted_rewards(task, {"mixed": 1.0}), prompts, responses, answers)
    with RewardPool("rlvr.tasks.mix:mix_task", opts, workers=1) as pool:
        there = score_batch(weighted_rewards(task, {"mixed": 1.0}), prompts, responses, answers, pool=pool)
    assert here.total == there.total and sum(here.total) == len(exs) // 2


@pytest.mark.parametrize("spec, needle", [
    ([], "non-empty list"),
    ([{"path": "rlvr.tasks.sort:sort_task", "options": {"n": 3, "heldout": 10}}], "fixed-length"),
    ([{**ADD, "reward": "nope"}], "no reward 'nope'"),
    ([{**ADD, "weight": 0}], "weight must be a number > 0"),
    ([{**ADD, "colour": "red"}], "unknown keys"),
    ([{**ADD, "path": "tasks/mine.py:make"}], "is a file"),
    ([{k: v for k, v in ADD.items() if k != "reward"}], "say which with reward"),
])
def test_bad_components_are_refused_naming_them(spec, needle):
    with pytest.raises(TaskError, match=needle):
        mix_task(spec)


def test_a_run_on_a_mixture_logs_each_components_goal(tmp_path):
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(io.StringIO()):
        rc = cli.main(["train", "examples/sort.toml", "--out", str(tmp_path / "run"),
                       "--task.path=rlvr.tasks.mix:mix_task", "--task.reward=mixed",
                       '--task.options={tasks = [{path = "rlvr.tasks.arith:arith_task", options = {ops = "+", '
                       'digits = 1, heldout = 10}, reward = "correct"}, {path = "rlvr.tasks.arith:arith_task", '
                       'options = {ops = "*", digits = 1, heldout = 8}, reward = "correct", name = "times"}]}',
                       "--eval.group_by=task", "--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2",
                       "--train.steps=1", "--train.prompts_per_step=4", "--train.samples_per_prompt=4",
                       "--eval.every=0", "--eval.pass_k=0", "--task.reward_workers=1"])
    assert rc == 0, out.getvalue()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if "eval/goal" in r][-1]
    assert final["eval/prompts_by_task/arith-add-1d"] == 10 and final["eval/prompts_by_task/times"] == 8
    goal = (10 * final["eval/goal_by_task/arith-add-1d"] + 8 * final["eval/goal_by_task/times"]) / 18
    assert goal == pytest.approx(final["eval/goal"])
