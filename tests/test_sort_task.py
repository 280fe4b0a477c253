"""The sort task, its three rewards and their cards, and the task contract."""


import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Example, Task, TaskError, load_task, validate_task
from rlvr.tasks.sort import (
    ENUMERATE_LIMIT,
    exact,
    goal,
    inclusion_adjacency,
    position,
    position_per_token,
    sort_task,
)


@pytest.fixture(scope="module")
def sort5():
    return sort_task()  # n=5 digits: 10**5 lists, every one in train or heldout


# --- rewards by hand -----------------------------------------------------------------------


def test_position_seed_table():
    # The worked example: truth 0 1 2 3;  0 1 2 3 -> 4,  2 1 3 0 -> 1,  1 0 2 3 -> 1.
    # Position-wise matching gives 4 and 1 for the first two rows, as printed. The third row
    # matches at positions 2 and 3 (2 == 2, 3 == 3), so it scores 2, not 1: that example's third
    # row is inconsistent with its own definition ("counts positions that match the sorted
    # truth") and we treat it as a typo.
    truth = "0123"
    assert position("3021=", "0123", truth) * 4 == 4
    assert position("3021=", "2130", truth) * 4 == 1
    assert position("3021=", "1023", truth) * 4 == 2  # seed prints 1; see above
    # the card's claim: two unrelated wrong answers score the same
    assert position("3021=", "0312", truth) == position("3021=", "2130", truth)


@pytest.mark.parametrize(
    "response, want",
    [
        ("11345", 1.0),
        ("11354", 3 / 5),
        ("54311", 1 / 5),  # only the middle 3
        ("31415", 2 / 5),  # positions 1 (1 == 1) and 4 (5 == 5)
        ("", 0.0),
        ("113", 3 / 5),
        ("113459", 5 / 6),  # the extra digit is a wrong position
        ("ab", 0.0),
    ],
)
def test_position_by_hand(response, want):
    assert position("31415=", response, "11345") == pytest.approx(want)


@pytest.mark.parametrize(
    "response, inclusion, adjacency",
    [
        ("11345", 5, 4),
        ("31415", 5, 2),  # copy: 1<=4 and 1<=5 are the ordered pairs
        ("11435", 5, 3),  # one swapped pair
        ("55555", 1, 4),  # one 5 in the prompt; a constant run is fully ordered
        ("99999", 0, 4),
        ("54311", 5, 1),  # 1<=1
        ("x1y3z", 2, 0),  # pairs with a non-digit never count
        ("", 0, 0),
        ("1134599999", 5, 4),  # adjacency is capped at n-1
    ],
)
def test_inclusion_adjacency_by_hand(response, inclusion, adjacency):
    assert inclusion_adjacency("31415=", response, "11345") == pytest.approx(
        (inclusion + adjacency) / 9
    )


def test_exact_and_goal_by_hand():
    assert exact("31415=", "11345", "11345") == 1.0
    assert goal("31415=", "11345", "11345") is True
    for wrong in ["11354", "1134", "113450", "", " 11345"]:
        assert exact("31415=", wrong, "11345") == 0.0
        assert goal("31415=", wrong, "11345") is False


def test_wide_format_rewards():
    t = sort_task(n=3, low=0, high=12, heldout=5, train=20)
    ex = t.heldout[0]
    assert ex.prompt.endswith("=") and len(ex.prompt) == 9  # "07,12,03="
    assert ex.answer == ",".join(sorted(ex.prompt[:-1].split(",")))
    assert t.max_new_tokens == len(ex.answer) == 8
    assert t.alphabet == "0123456789,="
    answer = "03,07,12"
    assert position("07,12,03=", "03,12,07", answer) == pytest.approx(1 / 3)
    assert inclusion_adjacency("07,12,03=", answer, answer) == 1.0
    # copy: all three numbers present, 07<=12 ordered, 12>03 not
    assert inclusion_adjacency("07,12,03=", "07,12,03", answer) == pytest.approx(4 / 5)
    assert inclusion_adjacency("07,12,03=", "7,12,3", answer) == pytest.approx(2 / 5)


@settings(max_examples=100, deadline=None)
@given(response=st.text(max_size=12), digits=st.lists(st.integers(0, 9), min_size=2, max_size=7))
def test_rewards_are_total_and_bounded(response, digits):
    prompt = "".join(map(str, digits)) + "="
    answer = "".join(map(str, sorted(digits)))
    for fn in (exact, position, inclusion_adjacency):
        v = fn(prompt, response, answer)
        assert type(v) is float and 0.0 <= v <= 1.0
    assert goal(prompt, response, answer) is (exact(prompt, response, answer) == 1.0)
    for fn in (position, inclusion_adjacency):
        assert fn(prompt, answer, answer) == 1.0


# --- cards: each exploit scores what its card claims, with the goal failed -----------------


def test_exact_card_has_no_exploit(sort5):
    assert sort5.rewards["exact"].card.exploit_example is None
    assert "none known" in sort5.rewards["exact"].card.exploit


def test_position_exploit_is_a_constant_scoring_the_claimed_mean(sort5):
    card = sort5.rewards["position"].card
    assert "'02579'" in card.exploit and "0.284" in card.exploit
    for ex in sort5.heldout:
        r = card.exploit_example(ex)
        assert len(r) == 5 and not goal(ex.prompt, r, ex.answer)
        # the same response for every prompt, except the 5! orderings of 0,2,5,7,9, where it
        # would be right: there one digit changes
        assert r == ("02570" if ex.answer == "02579" else "02579")


def test_position_exploit_mean_by_enumeration():
    # The card's mean comes from order statistics; enumerate every list of 3 digits as the
    # oracle. Counting hits as ints keeps the sum exact.
    t = sort_task(n=3, heldout=10)
    card = t.rewards["position"].card
    everything = list(t.train) + list(t.heldout)
    assert len(everything) == 1000
    hits = 0
    for ex in everything:
        r = card.exploit_example(ex)
        assert not goal(ex.prompt, r, ex.answer)
        hits += round(3 * position(ex.prompt, r, ex.answer))
    constant = card.exploit_example(Example("", ""))
    lucky = sum(ex.answer == constant for ex in everything)  # lists where it was changed
    mean = (hits + lucky) / (3 * len(everything))  # undo the change: the constant's own mean
    assert f"{constant!r}" in card.exploit
    assert f"{mean:.3f}" in card.exploit
    assert mean > 2 * 0.1  # uniform random digits score 0.1


# --- position_per_token: a process reward, one score per token ----------------------------


@pytest.mark.parametrize(
    "response, want",
    [
        ("11345", [1.0, 1.0, 1.0, 1.0, 1.0]),
        ("11354", [1.0, 1.0, 1.0, 0.0, 0.0]),
        ("54311", [0.0, 0.0, 1.0, 0.0, 0.0]),
        ("113", [1.0, 1.0, 1.0]),  # a special token was dropped: fewer scores, one per character
        ("113459", [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]),
        ("", [0.0]),
    ],
)
def test_position_per_token_by_hand(response, want):
    assert position_per_token("31415=", response, "11345") == want


def test_position_per_token_wide_format_credits_each_character():
    # 03,07,12 against 03,12,07: characters 0 3 , match, 1/0 and 2/7 differ, the comma matches, 0/0 matches
    assert position_per_token("07,12,03=", "03,12,07", "03,07,12") == [1, 1, 1, 0, 0, 1, 0, 0]
    assert position("07,12,03=", "03,12,07", "03,07,12") == pytest.approx(1 / 3)


@settings(max_examples=100, deadline=None)
@given(response=st.text(alphabet="0123456789", min_size=5, max_size=5),
       digits=st.lists(st.integers(0, 9), min_size=5, max_size=5))
def test_position_per_token_mean_is_position_on_one_digit_lists(response, digits):
    prompt = "".join(map(str, digits)) + "="
    answer = "".join(map(str, sorted(digits)))
    scores = position_per_token(prompt, response, answer)
    assert len(scores) == 5 and sum(scores) / 5 == pytest.approx(position(prompt, response, answer))


def test_position_per_token_card_claims(sort5):
    card = sort5.rewards["position_per_token"].card
    assert "'02579'" in card.exploit and "0.284" in card.exploit  # as `position` on one digit
    # several digits: enumerate every list of 2 numbers from 0..12 as the oracle
    t = sort_task(n=2, low=0, high=12, heldout=10)
    card = t.rewards["position_per_token"].card
    everything = list(t.train) + list(t.heldout)
    assert len(everything) == 13**2
    constant = card.exploit_example(Example("", ""))
    total = sum(sum(position_per_token(e.prompt, constant, e.answer)) for e in everything)
    mean = total / (len(constant) * len(everything))
    assert f"{constant!r}" in card.exploit and f"{mean:.3f}" in card.exploit
    # the separators and shared leading digits make the per-token mean far above `position`'s
    seq_mean = sum(position(e.prompt, constant, e.answer) for e in everything) / len(everything)
    assert mean > 2 * seq_mean and "separators" in card.exploit


def test_inclusion_adjacency_exploit_scores_8_of_9_without_solving(sort5):
    card = sort5.rewards["inclusion_adjacency"].card
    assert "0.889" in card.exploit and "0.800" in card.exploit
    for ex in list(sort5.heldout) + [Example("77777=", "77777"), Example("99999=", "99999")]:
        r = card.exploit_example(ex)
        solved = inclusion_adjacency(ex.prompt, ex.answer, ex.answer)
        got = inclusion_adjacency(ex.prompt, r, ex.answer)
        assert len(r) == 5 and not goal(ex.prompt, r, ex.answer)
        assert got == pytest.approx(8 / 9) and got >= 0.75 * solved
    assert card.exploit_example(Example("77777=", "77777")) == "77778"
    assert card.exploit_example(Example("99999=", "99999")) == "89999"


def test_copying_the_prompt_scores_the_claimed_mean():
    # Every list of 3 digits: inclusion 3 always, each of 2 pairs ordered with
    # P(a <= b) = 55/100, so the mean is (3 + 1.1) / 5 = 0.82; for n=5 the card says 0.800.
    t = sort_task(n=3, heldout=10)
    everything = list(t.train) + list(t.heldout)
    total = sum(
        round(5 * inclusion_adjacency(e.prompt, e.prompt[:-1], e.answer)) for e in everything
    )
    assert total / (5 * len(everything)) == 0.82
    assert "copying the prompt verbatim sorts nothing and scores 0.820" in t.rewards[
        "inclusion_adjacency"
    ].card.exploit


# --- the task: splits, determinism, contract -------------------------------------------------


def test_default_task_shape(sort5):
    t = sort5
    assert t.name == "sort-5" and t.max_new_tokens == 5 and t.fixed_length is True
    assert set(t.rewards) == {"exact", "position", "position_per_token", "inclusion_adjacency"}
    assert all(isinstance(r, Reward) and r.name == k for k, r in t.rewards.items())
    assert len(t.heldout) == 1000 and len(t.train) == 10**5 - 1000
    validate_task(t)
    for ex in t.heldout[:50]:
        digits = ex.prompt[:-1]
        assert ex.prompt[-1] == "=" and len(digits) == 5 and digits.isdigit()
        assert ex.answer == "".join(sorted(digits))


def test_heldout_disjoint_distinct_and_deterministic(sort5):
    held = [e.prompt for e in sort5.heldout]
    train = {e.prompt for e in sort5.train}
    assert len(set(held)) == len(held) and not train & set(held)
    again = sort_task(n=3, heldout=100, seed=0)
    same = sort_task(n=3, heldout=100, seed=0)
    other = sort_task(n=3, heldout=100, seed=1)
    assert [e.prompt for e in again.heldout] == [e.prompt for e in same.heldout]
    assert [e.prompt for e in again.train] == [e.prompt for e in same.train]
    assert [e.prompt for e in again.heldout] != [e.prompt for e in other.heldout]
    assert len(again.train) + len(again.heldout) == 1000


def test_train_size_in_a_small_space():
    t = sort_task(n=3, heldout=100, train=50, seed=3)
    assert len(t.train) == 50 and len(t.heldout) == 100
    assert not {e.prompt for e in t.train} & {e.prompt for e in t.heldout}


def test_large_space_samples_disjoint_and_deterministic():
    assert 10**7 > ENUMERATE_LIMIT
    a = sort_task(n=7, heldout=200, train=500, seed=5)
    b = sort_task(n=7, heldout=200, train=500, seed=5)
    assert [e.prompt for e in a.heldout] == [e.prompt for e in b.heldout]
    assert [e.prompt for e in a.train] == [e.prompt for e in b.train]
    assert len({e.prompt for e in a.heldout}) == 200 and len({e.prompt for e in a.train}) == 500
    assert not {e.prompt for e in a.train} & {e.prompt for e in a.heldout}
    validate_task(a)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 1}, "n must be at least 2"),
        ({"low": 5, "high": 5}, "low < high"),
        ({"low": -1}, "low < high"),
        ({"heldout": 0}, "heldout must be at least 1"),
        ({"n": 2, "heldout": 100}, "possible lists"),
        ({"n": 3, "heldout": 10, "train": 0}, "train must be None or a positive int"),
        ({"n": 2.5}, "n must be an int"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sort_task(**kwargs)


# --- load_task -----------------------------------------------------------------------------


def test_load_by_module_path_with_kwargs():
    t = load_task("rlvr.tasks.sort:TASK", n=3, heldout=10, seed=2)
    assert t.max_new_tokens == 3 and len(t.heldout) == 10
    assert [e.prompt for e in t.heldout] == [
        e.prompt for e in sort_task(n=3, heldout=10, seed=2).heldout
    ]
    assert load_task("rlvr.tasks.sort", n=2, heldout=5).max_new_tokens == 2  # NAME = TASK
    assert load_task("rlvr.tasks.sort:sort_task", n=4, heldout=5).max_new_tokens == 4


TINY = '''
from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Example, Task

def echo(prompt, response, answer):
    return 1.0 if response == answer else 0.0

CARD = RewardCard(pays_for="the echo", ignores="nothing", exploit="none")

def make(n_train=3, broken=None):
    train = [Example(f"t{i}", f"t{i}") for i in range(n_train)]
    heldout = [Example("h0", "h0"), Example("h1", "h1")]
    rewards = {"echo": Reward("echo", echo, CARD)}
    kw = dict(max_new_tokens=4)
    if broken == "empty_heldout":
        heldout = []
    elif broken == "overlap":
        heldout = heldout + [Example("t1", "t1")]
    elif broken == "not_callable":
        rewards = {"echo": Reward("echo", "echo", CARD)}
    elif broken == "no_card":
        rewards = {"echo": Reward("echo", echo, None)}
    elif broken == "blank_card":
        rewards = {"echo": Reward("echo", echo, RewardCard("x", "", "z"))}
    elif broken == "not_a_reward":
        rewards = {"echo": echo}
    elif broken == "zero_tokens":
        kw["max_new_tokens"] = 0
    elif broken == "str_tokens":
        kw["max_new_tokens"] = "4"
    elif broken == "alphabet":
        kw["alphabet"] = "th"
    elif broken == "goal":
        return Task("tiny", train, heldout, rewards, goal=None, **kw)
    return Task("tiny", train, heldout, rewards, goal=echo, **kw)

VALUE = make()
NOT_A_TASK = 3

def returns_dict():
    return {"name": "tiny"}
'''


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny_task.py"
    path.write_text(TINY)
    return str(path)


def test_load_by_file_path_with_kwargs(tiny):
    t = load_task(f"{tiny}:make", n_train=5)
    assert t.name == "tiny" and len(t.train) == 5 and t.fixed_length is False
    assert load_task(f"{tiny}:VALUE").train[0] == Example("t0", "t0")


@pytest.mark.parametrize(
    "broken, message",
    [
        ("empty_heldout", "heldout is empty"),
        ("overlap", "heldout overlaps train: 1 held-out prompt(s) also in train, e.g. ['t1']"),
        ("not_callable", "rewards['echo'].fn is not callable"),
        ("no_card", "rewards['echo'] has no RewardCard"),
        ("blank_card", "rewards['echo'].card.ignores must be a non-empty str"),
        ("not_a_reward", "rewards['echo'] is a function, not a rlvr.rewards.Reward"),
        ("zero_tokens", "max_new_tokens must be a positive int, got 0"),
        ("str_tokens", "max_new_tokens must be a positive int, got '4'"),
        ("alphabet", "alphabet 'th' lacks prompt characters '012'"),
        ("goal", "goal is not callable"),
    ],
)
def test_contract_errors_name_the_field_and_the_path(tiny, broken, message):
    with pytest.raises(TaskError) as e:
        load_task(f"{tiny}:make", broken=broken)
    assert str(e.value).startswith(f"{tiny}:make: task 'tiny' breaks the contract: ")
    assert message in str(e.value)


def test_missing_file(tmp_path):
    path = f"{tmp_path}/nope.py:TASK"
    with pytest.raises(TaskError, match="file does not exist") as e:
        load_task(path)
    assert path in str(e.value)


def test_missing_module():
    with pytest.raises(TaskError, match="no module named 'no_such_pkg_xyz.tasks'") as e:
        load_task("no_such_pkg_xyz.tasks:TASK")
    assert str(e.value).startswith("no_such_pkg_xyz.tasks:TASK: ")


def test_file_that_does_not_import_shows_the_error(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import json\nraise RuntimeError('boom at import')\n")
    with pytest.raises(TaskError, match="failed to import: RuntimeError: boom at import") as e:
        load_task(f"{bad}:TASK")
    assert str(bad) in str(e.value)
    dep = tmp_path / "dep.py"
    dep.write_text("import not_installed_pkg_xyz\n")
    with pytest.raises(TaskError, match="ModuleNotFoundError: No module named 'not_installed"):
        load_task(f"{dep}:TASK")


@pytest.mark.parametrize("source, where", [
    ("import sys\nsys.exit(0)\n", "importing"),
    ("raise SystemExit('bye')\n", "importing"),
    ("import sys\ndef make():\n    sys.exit(3)\n", "calling make(**{})"),
])
def test_a_task_that_exits_is_an_error_never_a_silent_exit(tmp_path, source, where):
    bad = tmp_path / "leaves.py"
    bad.write_text(source)
    with pytest.raises(TaskError, match="raised SystemExit") as e:
        load_task(f"{bad}:make")
    assert str(e.value).startswith(f"{bad}:make: {where}")
    mod = tmp_path / "pkg_that_exits_xyz.py"
    mod.write_text("import sys\nsys.exit(0)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(TaskError, match="importing module 'pkg_that_exits_xyz' raised SystemExit"):
            load_task("pkg_that_exits_xyz:TASK")
    finally:
        sys.path.remove(str(tmp_path))


def test_missing_name_lists_what_is_there(tiny):
    with pytest.raises(TaskError) as e:
        load_task(f"{tiny}:MAKE")
    msg = str(e.value)
    assert msg.startswith(f"{tiny}:MAKE: ") and "has no 'MAKE'" in msg
    assert "VALUE" in msg and "make" in msg and "echo" in msg
    assert "Reward" not in msg.split("there:")[1]  # imported names are not candidates


def test_not_a_task(tiny):
    with pytest.raises(TaskError, match="NOT_A_TASK is a int, not a Task or a function"):
        load_task(f"{tiny}:NOT_A_TASK")
    with pytest.raises(TaskError, match=r"returns_dict\(...\) returned a dict, not a Task"):
        load_task(f"{tiny}:returns_dict")


def test_kwargs_errors(tiny):
    with pytest.raises(TaskError, match="VALUE is a Task value, so it takes no arguments"):
        load_task(f"{tiny}:VALUE", n_train=2)
    with pytest.raises(TaskError, match=r"task.options 'm' is not taken by TASK\(\); it takes: n, low, high") as e:
        load_task("rlvr.tasks.sort:TASK", m=3)
    assert str(e.value).startswith("rlvr.tasks.sort:TASK: ")
    with pytest.raises(TaskError, match="n must be at least 2"):
        load_task("rlvr.tasks.sort:TASK", n=1)


def test_validate_rejects_non_tasks_and_bad_examples():
    with pytest.raises(TaskError, match="is a dict, not a rlvr.tasks.Task"):
        validate_task({})
    card = RewardCard("a", "b", "c")
    good = dict(
        name="t",
        train=[Example("a", "a")],
        heldout=[Example("b", "b")],
        rewards={"r": Reward("r", lambda p, r, a: 0.0, card)},
        goal=lambda p, r, a: True,
        max_new_tokens=1,
    )
    validate_task(Task(**good))
    with pytest.raises(TaskError, match=r"train\[0\] is a tuple, not an Example"):
        validate_task(Task(**{**good, "train": [("a", "a")]}))
    with pytest.raises(TaskError, match=r"heldout\[0\].prompt is a int, not a str"):
        validate_task(Task(**{**good, "heldout": [Example(7, "b")]}))
    with pytest.raises(TaskError, match="train is empty"):
        validate_task(Task(**{**good, "train": []}))
    with pytest.raises(TaskError, match="max_new_tokens must be a positive int, got True"):
        validate_task(Task(**{**good, "max_new_tokens": True}))
    with pytest.raises(TaskError, match="key must be its name"):
        validate_task(Task(**{**good, "rewards": {"x": Reward("r", lambda p, r, a: 0.0, card)}}))


def test_step_delimiter_must_be_a_str(sort5):
    import dataclasses

    with pytest.raises(TaskError, match="step_delimiter must be a str"):
        validate_task(dataclasses.replace(sort5, step_delimiter=None))
    assert sort5.step_delimiter == ""  # one step per token


def test_position_per_token_end_to_end_to_a_per_token_delta():
    """score_batch -> steps_of -> token_steps (character tokenizer) -> pad_steps -> process_delta ->
    policy_loss, on three responses to '311=' (answer '113'), one with a special token inside."""
    import torch

    from rlvr import advantages, losses
    from rlvr.rewards import score_batch, steps_of
    from rlvr.tokenizer import CharTokenizer

    t = sort_task(n=3, heldout=10)
    tok = CharTokenizer(t.alphabet)
    ids = [tok.encode("113"), tok.encode("131"), [tok.encode("1")[0], tok.bos_id, tok.encode("3")[0]]]
    texts = [[tok.decode([i]) for i in row] for row in ids]  # the special decodes to ""
    responses = ["".join(x) for x in texts]
    assert responses == ["113", "131", "13"]
    scores = score_batch({"position_per_token": (t.rewards["position_per_token"], 1.0)},
                         ["311="] * 3, responses, ["113"] * 3)
    steps = [steps_of(v) for v in scores.per_reward["position_per_token"]]
    assert steps == [(1.0, 1.0, 1.0), (1.0, 0.0, 0.0), (1.0, 0.0)]
    token_step = advantages.token_steps(texts, t.step_delimiter, 3)
    assert token_step.tolist() == [[0, 1, 2], [0, 1, 2], [0, -1, 1]]
    step_scores, step_mask = advantages.pad_steps(steps, 3)
    delta = advantages.process_delta(step_scores, step_mask, token_step, "per_step_centered")
    # step 0 agrees (all 1) -> 0; step 1: 1, 0, 0 -> 2/3, -1/3, -1/3; step 2 only in rows 0, 1: ±1/2
    want = torch.tensor([[0.0, 2 / 3, 0.5], [0.0, -1 / 3, -0.5], [0.0, 0.0, -1 / 3]])
    assert torch.allclose(delta, want.to(delta.dtype))
    assert not advantages.step_mismatch(step_mask, token_step).any()
    logp = torch.full((3, 3), -1.0, requires_grad=True)
    loss, _ = losses.policy_loss(logp, logp.detach(), delta, torch.ones(3, 3), agg="seq_sum_mean")
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, -want.to(grad.dtype) / 3)  # -Δ/B per token at ratio 1
