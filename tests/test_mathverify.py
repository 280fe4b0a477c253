"""rlvr.tasks.mathverify: math-verify in a worker process, timeouts that never hang, the task."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("math_verify")

from rlvr.rewards import score, score_batch  # noqa: E402
from rlvr.tasks import load_task, weighted_rewards  # noqa: E402
from rlvr.tasks import mathverify as mv  # noqa: E402


@pytest.fixture(scope="module")
def verifier():
    v = mv.get_verifier()  # the module's one worker, shared by every test here
    yield v


@pytest.mark.parametrize("gold,response,want", [
    ("\\frac{1}{2}", "0.5", 1.0),
    ("0.5", "\\frac{1}{2}", 1.0),
    ("\\frac{1}{2}", "The answer is \\boxed{\\frac12}.", 1.0),
    ("\\frac{1}{2}", "\\boxed{0.6}", 0.0),
    ("3", "no number here", 0.0),
])
def test_math_equal(verifier, gold, response, want):
    assert mv.math_equal("", response, gold) == want


def test_timeout_is_bounded_counted_and_the_worker_restarts(verifier):
    verifier.call("ping")
    pid, restarts = verifier.pid, verifier.restarts
    t = time.monotonic()
    with pytest.raises(TimeoutError, match="longer than 0.3s"):
        verifier.call("sleep", 30, timeout=0.3)  # stands in for a sympy call that hangs
    assert time.monotonic() - t < 5
    assert verifier.restarts == restarts + 1 and verifier.pid is None
    assert mv.math_equal("", "1/2", "0.5") == 1.0  # a fresh worker answers
    assert verifier.pid not in (None, pid)


def test_timeout_reaches_the_status_system(verifier, monkeypatch):
    def slow(gold, response, timeout=None):  # a check that hangs, through the real worker
        return verifier.call("sleep", 5, timeout=0.2)

    monkeypatch.setattr(verifier, "equal", slow)
    s = score(mv.MATH_EQUAL, "", "1", "1")
    assert s.status == "error" and "TimeoutError" in s.detail


def test_errors_are_counted_not_zero(verifier):
    b = score_batch({"m": (mv.MATH_EQUAL, 1.0)}, ["", ""], ["1", "1"], ["\\boxed{", "1"])
    assert b.status_counts["error"] == 1 and b.per_reward["m"] == [0.0, 1.0]
    with pytest.raises(ValueError, match="unknown worker function"):
        verifier.call("eval", "1+1")


def test_builtin_task(verifier):
    task = load_task("rlvr.tasks.mathverify:math_task", train=40, heldout=10)
    assert task.alphabet is None and not {e.prompt for e in task.train} & {e.prompt for e in task.heldout}
    ex = task.heldout[0]
    assert task.goal(ex.prompt, f"\\boxed{{{ex.meta['value']}}}", ex.answer)
    assert not task.goal(ex.prompt, "\\boxed{1000}", ex.answer)
    assert mv.MATH_EQUAL.card.exploit_example(ex).endswith("x")


def test_jsonl_task(tmp_path, verifier):
    p = tmp_path / "m.jsonl"
    rows = [{"problem": f"p{i}", "answer": a} for i, a in enumerate(["\\frac{1}{2}", "2", "\\sqrt{4}", "7"])]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = mv.math_task(str(p), heldout_fraction=0.25)
    ex = next(e for e in task.train + task.heldout if e.prompt == "p0")
    b = score_batch(weighted_rewards(task, {"math_equal": 1.0}), ["p0"] * 2, ["0.5", "0.4"], [ex.answer] * 2)
    assert b.per_reward["math_equal"] == [1.0, 0.0] and b.failed == 0
