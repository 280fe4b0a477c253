"""Safe scoring: every failure of a reward gets a named status, never a silent 0."""

import math

import pytest

from rlvr.rewards import (
    MAX_ERRORS_KEPT,
    STATUSES,
    BatchScores,
    Reward,
    RewardCard,
    Score,
    StepScores,
    score,
    score_batch,
    steps_of,
)


def const(v):
    return lambda prompt, response, answer: v


def boom(prompt, response, answer):
    raise ZeroDivisionError(f"cannot score {response!r}")


def length(prompt, response, answer):
    return float(len(response))


def match(prompt, response, answer):
    return 1.0 if response == answer else 0.0


CARD = RewardCard(pays_for="x", ignores="y", exploit="z")


# --- score: one status per way a reward can fail ------------------------------------------


def test_ok_float():
    assert score(const(0.25), "p", "r", "a") == Score(0.25, "ok", "")


def test_ok_int_and_bool_are_numbers():
    assert score(const(3), "p", "r", "a") == (3.0, "ok", "")
    assert score(const(True), "p", "r", "a") == (1.0, "ok", "")
    assert type(score(const(3), "p", "r", "a").value) is float


def test_raises_gives_error_with_the_exception_text():
    s = score(boom, "p", "12", "a")
    assert (s.value, s.status) == (0.0, "error")
    assert s.detail == "ZeroDivisionError: cannot score '12'"


def test_none():
    assert score(const(None), "p", "r", "a")[:2] == (0.0, "none")


@pytest.mark.parametrize("v", [math.nan, math.inf, -math.inf])
def test_nan_and_inf(v):
    s = score(const(v), "p", "r", "a")
    assert (s.value, s.status) == (0.0, "nan")


@pytest.mark.parametrize("v", ["1.0", b"1", {"r": 1}, 1j, object()])
def test_bad_type(v):
    s = score(const(v), "p", "r", "a")
    assert (s.value, s.status) == (0.0, "bad_type")
    assert type(v).__name__ in s.detail


def test_numpy_and_tensor_scalars_are_numbers():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    assert score(const(np.float32(0.5)), "p", "r", "a")[:2] == (0.5, "ok")
    assert score(const(torch.tensor(0.5)), "p", "r", "a")[:2] == (0.5, "ok")
    assert score(const(torch.tensor([0.5, 1.0])), "p", "r", "a").status == "bad_type"
    assert score(const(np.float64("nan")), "p", "r", "a").status == "nan"


def test_accepts_a_reward_object():
    r = Reward("len", length, CARD)
    assert score(r, "p", "abc", None) == (3.0, "ok", "")
    assert r("p", "ab", None) == 2.0


def counts(**nonzero):
    """Every status, 0 unless given."""
    return {s: nonzero.get(s, 0) for s in STATUSES}


def test_sys_exit_in_a_reward_is_status_exit():
    def leave(prompt, response, answer):
        raise SystemExit(3)

    assert score(leave, "p", "r", "a") == Score(0.0, "exit", "SystemExit: 3")
    b = score_batch({"leave": (leave, 1.0)}, ["p"] * 2, ["a", "b"], [0, 0])
    assert b.status_counts == counts(exit=2) and b.errors == ["leave: SystemExit: 3"]


def test_keyboard_interrupt_is_status_exit_only_where_asked():
    def stop(prompt, response, answer):
        raise KeyboardInterrupt

    assert score(stop, "p", "r", "a", interrupts=True) == Score(0.0, "exit", "KeyboardInterrupt")


def test_keyboard_interrupt_is_not_swallowed():
    def stop(prompt, response, answer):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score(stop, "p", "r", "a")


# --- score_batch: weighted sums, per-reward values, status counts -------------------------


def test_weighted_sum_by_hand():
    prompts = ["p"] * 3
    responses = ["ab", "x", "abcd"]
    answers = ["ab", "ab", "ab"]
    b = score_batch({"match": (match, 2.0), "len": (length, 0.5)}, prompts, responses, answers)
    assert isinstance(b, BatchScores)
    assert b.per_reward == {"match": [1.0, 0.0, 0.0], "len": [2.0, 1.0, 4.0]}
    # 2*1 + 0.5*2 = 3; 2*0 + 0.5*1 = 0.5; 2*0 + 0.5*4 = 2
    assert b.total == [3.0, 0.5, 2.0]
    assert b.status_counts == counts(ok=6)
    assert b.failed == 0 and b.errors == []


def test_failures_count_zero_and_are_counted():
    table = {"a": 1.0, "b": None, "c": math.nan, "d": "1"}

    def picky(prompt, response, answer):
        if response not in table:
            boom(prompt, response, answer)
        return table[response]

    responses = ["a", "b", "c", "d", "e", "a"]
    b = score_batch(
        {"picky": (Reward("picky", picky, CARD), 1.0), "len": (length, 1.0)},
        ["p"] * 6,
        responses,
        [None] * 6,
    )
    assert b.per_reward["picky"] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert b.total == [2.0, 1.0, 1.0, 1.0, 1.0, 2.0]
    assert b.status_by_reward["picky"] == counts(ok=2, error=1, none=1, nan=1, bad_type=1)
    assert b.status_by_reward["len"] == counts(ok=6)
    assert b.status_counts == counts(ok=8, error=1, none=1, nan=1, bad_type=1)
    assert b.failed == 4
    assert "picky: ZeroDivisionError: cannot score 'e'" in b.errors
    assert "picky: returned None" in b.errors


def test_errors_kept_are_distinct_and_capped():
    b = score_batch({"boom": (boom, 1.0)}, ["p"] * 20, [str(i % 10) for i in range(20)], [0] * 20)
    assert b.status_counts["error"] == 20
    assert len(b.errors) == MAX_ERRORS_KEPT
    assert len(set(b.errors)) == MAX_ERRORS_KEPT


def test_every_status_is_a_key_even_when_zero():
    b = score_batch({"m": (match, 1.0)}, ["p"], ["a"], ["a"])
    assert list(b.status_counts) == list(STATUSES)


def test_zero_weight_keeps_per_reward_values():
    b = score_batch({"len": (length, 0.0)}, ["p"], ["abc"], [None])
    assert b.total == [0.0] and b.per_reward["len"] == [3.0]


def test_misaligned_or_empty_inputs_raise():
    with pytest.raises(ValueError, match="aligned"):
        score_batch({"m": (match, 1.0)}, ["p", "p"], ["a"], ["a"])
    with pytest.raises(ValueError, match="no rewards"):
        score_batch({}, ["p"], ["a"], ["a"])


def test_empty_batch():
    b = score_batch({"m": (match, 1.0)}, [], [], [])
    assert b.total == [] and b.per_reward == {"m": []} and b.failed == 0


def test_batch_fn_scores_all_responses_in_one_call_with_statuses():
    from rlvr.rewards import Reward, RewardCard, score_batch

    calls = []

    def batch(prompts, responses, answers):
        calls.append(len(responses))
        return [1.0, None, float("nan"), 0.5]

    card = RewardCard("x", "y", "z")
    r = Reward("b", lambda p, s, a: 9.0, card, batch_fn=batch)
    out = score_batch({"b": (r, 2.0)}, ["p"] * 4, ["r1", "r2", "r3", "r4"], ["a"] * 4)
    assert calls == [4]
    assert out.per_reward["b"] == [1.0, 0.0, 0.0, 0.5] and out.total == [2.0, 0.0, 0.0, 1.0]
    assert out.status_counts["ok"] == 2 and out.status_counts["none"] == 1 and out.status_counts["nan"] == 1


def test_failing_batch_fn_falls_back_to_one_by_one():
    from rlvr.rewards import Reward, RewardCard, score_batch

    def boom(prompts, responses, answers):
        raise RuntimeError("batch down")

    def item(p, s, a):
        if s == "bad":
            raise ValueError("this one")
        return 1.0

    card = RewardCard("x", "y", "z")
    for batch_fn in (boom, lambda p, s, a: [1.0]):     # raises; wrong count
        r = Reward("b", item, card, batch_fn=batch_fn)
        out = score_batch({"b": (r, 1.0)}, ["p"] * 3, ["ok", "bad", "ok"], ["a"] * 3)
        assert out.per_reward["b"] == [1.0, 0.0, 1.0]
        assert out.status_counts["error"] == 1 and "this one" in out.errors[0]


# --- process rewards: a list of per-step scores --------------------------------------------


def test_list_of_numbers_is_a_process_reward():
    s = score(const([1.0, 0.0, 1, True]), "p", "r", "a")
    assert s == (0.75, "ok", "") and isinstance(s.value, StepScores)
    assert steps_of(s.value) == (1.0, 0.0, 1.0, 1.0) and all(type(x) is float for x in steps_of(s.value))
    assert steps_of(score(const((0.5,)), "p", "r", "a").value) == (0.5,)
    assert steps_of(score(const(0.5), "p", "r", "a").value) == ()
    # arithmetic and JSON see the mean; pickling keeps the steps
    import json
    import pickle

    assert type(s.value + 0.0) is float and json.dumps(s.value) == "0.75"
    back = pickle.loads(pickle.dumps(s.value))
    assert back == 0.75 and steps_of(back) == (1.0, 0.0, 1.0, 1.0)
    assert score(const(s.value), "p", "r", "a").value is s.value  # an already-checked value passes


@pytest.mark.parametrize(
    "v, status, detail",
    [
        ([], "bad_type", "empty list"),
        ([1.0, "x"], "bad_type", "step 1"),
        ([1.0, None], "none", "step 1"),
        ([math.nan, 1.0], "nan", "step 0"),
        ([1.0, [0.0]], "bad_type", "step 1: a nested list"),
    ],
)
def test_bad_process_rewards_have_a_status(v, status, detail):
    s = score(const(v), "p", "r", "a")
    assert (s.value, s.status) == (0.0, status) and steps_of(s.value) == ()
    assert detail in s.detail


def test_score_batch_carries_the_steps_in_per_reward():
    def per_char(prompt, response, answer):
        return [float(a == b) for a, b in zip(response, answer)] or None

    b = score_batch({"pc": (per_char, 2.0), "m": (match, 1.0)}, ["p"] * 3, ["ab", "ax", ""], ["ab"] * 3)
    assert b.per_reward["pc"] == [1.0, 0.5, 0.0]
    assert [steps_of(v) for v in b.per_reward["pc"]] == [(1.0, 1.0), (1.0, 0.0), ()]  # "" returned None
    assert [steps_of(v) for v in b.per_reward["m"]] == [(), (), ()]
    assert b.total == [3.0, 1.0, 0.0] and all(type(x) is float for x in b.total)
    assert b.status_by_reward["pc"]["none"] == 1
