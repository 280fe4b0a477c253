"""eval.group_by: the held-out goal per value of a meta key, by hand and through a run."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from types import SimpleNamespace

import pytest

from rlvr import build as build_mod, config as config_mod, setup_types
from rlvr.evaluate import MAX_GROUPS, goal_by_groups


def ex(**meta):
    return SimpleNamespace(meta=meta)


def test_goal_by_groups_by_hand():
    examples = [ex(op="+"), ex(op="+"), ex(op="*"), ex(), ex(op="+"), ex(op=3)]
    hits = [True, False, True, True, True, False]
    assert goal_by_groups(examples, hits, "op") == {
        "goal_by_op/(none)": 1.0, "prompts_by_op/(none)": 1,
        "goal_by_op/*": 1.0, "prompts_by_op/*": 1,
        "goal_by_op/+": 2 / 3, "prompts_by_op/+": 3,
        "goal_by_op/3": 0.0, "prompts_by_op/3": 1,
    }
    many = [ex(k=i % 60) for i in range(600)] + [ex(k=7)]       # 60 values, value 7 the largest
    out = goal_by_groups(many, [True] * len(many), "k")
    assert len(out) == 2 * MAX_GROUPS and out["prompts_by_k/7"] == 11
    assert "prompts_by_k/59" not in out                             # ties kept in order of value: 10..59 dropped first


def test_a_run_reports_the_goal_by_operation(tmp_path):
    from rlvr.cli import main

    config = tmp_path / "arith.toml"
    config.write_text('[task]\npath = "rlvr.tasks.arith:arith_task"\nreward = "correct"\n'
                      'options = { ops = "+-*", digits = 1, heldout = 30, max_new_tokens = 4 }\n'
                      '[eval]\ngroup_by = "op"\npass_k = 0\nevery = 0\n')
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["train", str(config), "--out", str(tmp_path / "run"), "--model.n_layer=1", "--model.n_embd=32",
                   "--model.n_head=2", "--train.steps=1", "--train.prompts_per_step=4",
                   "--train.samples_per_prompt=2", "--task.reward_workers=0"])
    assert rc == 0, err.getvalue()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if "eval/goal" in r][-1]
    counts = {op: final[f"eval/prompts_by_op/{op}"] for op in "+-*"}
    assert sum(counts.values()) == 30 and all(counts.values())
    assert final["eval/goal"] == pytest.approx(sum(final[f"eval/goal_by_op/{op}"] * counts[op] for op in "+-*") / 30)
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert main(["eval", str(tmp_path / "run")]) == 0                 # rlvr eval reports them too
    assert json.loads(out.getvalue())["eval/goal_by_op/+"] == final["eval/goal_by_op/+"]


def test_a_key_no_held_out_example_has_is_refused_before_any_compute():
    cfg = config_mod.load(None, ["--task.path=rlvr.tasks.arith:arith_task", "--task.options={digits = 1, heldout = 5}",
                                 "--task.reward=correct", "--eval.group_by=level"])
    with pytest.raises(setup_types.RunError, match="eval.group_by = 'level'.*their keys: a, b, expr, messages, op, operands, ops\\)"):
        build_mod.build(cfg, log=lambda *a: None)


def test_evaluate_returns_each_prompts_hit_in_held_out_order_when_asked(monkeypatch):
    """evaluate(hits=True): the greedy hit of every prompt, 1 or 0 in the held-out order (a paired
    comparison of two models reads them prompt by prompt); not there unless asked."""
    import torch

    from rlvr import evaluate as evaluate_mod

    examples = [ex(op="+") for _ in range(5)]
    task = SimpleNamespace(heldout=examples)
    seen = []

    def fake_sample_and_score(policy, tok, task_, chosen, **kw):
        seen.append(chosen)
        return SimpleNamespace(hits=torch.tensor([[True], [False], [True], [True], [False]]), totals=[1.0, 0.0, 1.0, 1.0, 0.0],
                               reward_failures=0, goal_failures=0, tools=None)

    monkeypatch.setattr(evaluate_mod, "sample_and_score", fake_sample_and_score)
    model = torch.nn.Linear(1, 1)
    kw = dict(reward_weights={"correct": 1.0}, limits=None, prompts=5)
    res = evaluate_mod.evaluate(model, None, task, hits=True, **kw)
    assert seen[0] == examples
    assert res["hits"] == [1, 0, 1, 1, 0] and res["goal"] == pytest.approx(3 / 5)
    assert "hits" not in evaluate_mod.evaluate(model, None, task, **kw)
