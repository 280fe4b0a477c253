"""rlvr.tasks.arith: numbers read from replies, the two rewards and their cards, the split, the prompts."""

from decimal import Decimal

import pytest

from rlvr.rewards import score
from rlvr.tasks import load_task
from rlvr.tasks.arith import arith_task, correct, format_reward, goal, last_number, numbers
from rlvr.tokenizer import encode_example

P = "What is 23 + 45? Reply with the number only."


@pytest.mark.parametrize("text,expected", [
    ("68", [68]),
    ("23 + 45 = 68", [23, 45, 68]),
    ("23-45", [23, 45]),                     # a minus glued to a digit is an operator
    ("45 - 23 = 22, or -22 backwards", [45, 23, 22, -22]),
    ("It is 1,234.", [1234]),                # thousands separators; the final '.' ends the sentence
    ("1,2,3", [1, 2, 3]),                    # not thousands: two digits after a comma are too few
    ("68.0 or 68.5", [Decimal("68.0"), Decimal("68.5")]),
    ("no digits here", []),
])
def test_numbers_read_from_a_reply(text, expected):
    assert numbers(text) == expected


def test_correct_pays_for_the_last_number_only():
    assert correct(P, "68", 68) == 1.0
    assert correct(P, "23 + 45 = 68", 68) == 1.0            # working before it is ignored
    assert correct(P, "The answer is 68.", 68) == 1.0
    assert correct(P, "68.0", 68) == 1.0                    # the same number
    assert correct(P, "68 or 78", 68) == 0.0                # the last number is 78
    assert correct(P, "78, no, 68", 68) == 1.0              # the card says so: the last one counts
    assert correct(P, "68.5", 68) == 0.0
    assert correct(P, "", 68) == 0.0 and last_number("") is None
    assert correct(P, "45 - 23 = -22", -22) == 1.0
    for resp in ("68", "23 + 45 = 68", "78", "", "sixty-eight"):
        assert goal(P, resp, 68) == (correct(P, resp, 68) == 1.0)


def test_format_pays_for_a_bare_number_right_or_wrong():
    assert format_reward(P, "68", 68) == 1.0
    assert format_reward(P, " 78\n", 68) == 1.0             # wrong, but a bare number
    assert format_reward(P, "-3", 68) == 1.0
    assert format_reward(P, "68.", 68) == 0.0               # trailing punctuation
    assert format_reward(P, "The answer is 68", 68) == 0.0
    assert format_reward(P, "23 + 45 = 68", 68) == 0.0
    assert format_reward(P, "", 68) == 0.0


def test_cards_and_the_format_exploit():
    task = arith_task(digits=1, heldout=5)
    assert set(task.rewards) == {"correct", "format"}
    assert task.rewards["correct"].card.exploit_example is None
    ex = task.heldout[0]
    hack = task.rewards["format"].card.exploit_example(ex)
    assert hack == str(ex.answer + 1)
    assert score(task.rewards["format"], ex.prompt, hack, ex.answer).value == 1.0
    assert score(task.rewards["correct"], ex.prompt, hack, ex.answer).value == 0.0
    assert not task.goal(ex.prompt, hack, ex.answer)


def test_one_digit_problems_are_all_there_once_and_right():
    task = load_task("rlvr.tasks.arith", ops="+-*", digits=1, heldout=10, seed=3)
    assert task.name == "arith-add-sub-mul-1d" and not task.fixed_length and task.max_new_tokens == 16
    # 0..9: 55 unordered pairs (with repeats) for + and *, 55 pairs a >= b for -: 165 problems
    everything = list(task.train) + list(task.heldout)
    assert len(task.heldout) == 10 and len(everything) == 165
    keys = [(ex.meta["op"], *sorted((ex.meta["a"], ex.meta["b"]))) for ex in everything]
    assert len(set(keys)) == 165
    by_prompt = {ex.prompt: ex.answer for ex in everything}
    seven_eight = by_prompt.get("What is 7 * 8? Reply with the number only.",
                                by_prompt.get("What is 8 * 7? Reply with the number only."))
    assert seven_eight == 56
    assert by_prompt["What is 9 - 4? Reply with the number only."] == 5       # larger operand first
    assert "What is 4 - 9? Reply with the number only." not in by_prompt
    assert all(ex.answer >= 0 for ex in everything)
    for ex in everything:
        a, op, b = ex.meta["a"], ex.meta["op"], ex.meta["b"]
        assert ex.prompt == f"What is {a} {op} {b}? Reply with the number only."
        assert ex.answer == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert ex.meta["messages"] == [{"role": "user", "content": ex.prompt}]


def test_heldout_is_disjoint_by_operand_pair_and_seeded():
    task = arith_task(ops="+", digits=2, heldout=100, seed=0)
    assert len(task.train) + len(task.heldout) == 90 * 91 // 2                 # 10..99, unordered pairs
    def pairs(examples):
        return {(min(ex.meta["a"], ex.meta["b"]), max(ex.meta["a"], ex.meta["b"])) for ex in examples}

    assert len(pairs(task.heldout)) == 100 and not pairs(task.heldout) & pairs(task.train)   # 23+45 vs 45+23 too
    assert all(10 <= ex.meta["a"] <= 99 and 10 <= ex.meta["b"] <= 99 for ex in task.heldout)
    again = arith_task(ops="+", digits=2, heldout=100, seed=0)
    assert [ex.prompt for ex in again.heldout] == [ex.prompt for ex in task.heldout]
    other = arith_task(ops="+", digits=2, heldout=100, seed=1)
    assert [ex.prompt for ex in other.heldout] != [ex.prompt for ex in task.heldout]
    small = arith_task(ops="+", digits=2, heldout=100, n_train=50, seed=0)
    assert len(small.train) == 50 and [ex.prompt for ex in small.heldout] == [ex.prompt for ex in task.heldout]
    big = arith_task(ops="*", digits=4, heldout=20, n_train=30)               # 9000^2 / 2 problems: sampled
    assert len(big.train) == 30 and all(1000 <= ex.meta["a"] <= 9999 for ex in big.train)
    assert not pairs(big.heldout) & pairs(big.train)


def test_prompt_template_and_bad_arguments():
    task = arith_task(digits=1, heldout=3, prompt_template="{a}{op}{b}=")
    assert all(ex.prompt == f"{ex.meta['a']}+{ex.meta['b']}=" for ex in task.train)
    with pytest.raises(ValueError, match="must use {a} and {b}"):
        arith_task(prompt_template="What is {a} plus {c}?")
    with pytest.raises(ValueError, match="must show {op}"):
        arith_task(ops="+-", prompt_template="{a} {b}")
    with pytest.raises(ValueError, match="ops must be distinct characters"):
        arith_task(ops="/")
    with pytest.raises(ValueError, match="only 55"):
        arith_task(digits=1, heldout=50, n_train=10)
    with pytest.raises(ValueError, match="digits must be a positive int"):
        arith_task(digits=0)


def test_chat_tokenizers_get_the_messages_and_char_tokenizers_the_prompt():
    class ChatTok:
        has_chat_template = True

        def encode_prompt(self, prompt):
            return ["chat", prompt] if isinstance(prompt, list) else ["plain", prompt]

    class CharTok:
        has_chat_template = False

        def encode_prompt(self, text):
            return list(text)

    ex = arith_task(digits=1, heldout=1).heldout[0]
    assert encode_example(ChatTok(), ex) == ["chat", [{"role": "user", "content": ex.prompt}]]
    assert encode_example(CharTok(), ex) == list(ex.prompt)


# ---------------------------------------------------------------------- chain of thought (reasoning=True)
from rlvr.tasks.arith import answer_correct, answer_format, answer_goal, chain_value, final_answer  # noqa: E402

Q = "What is 412 + 37 * 5? Think step by step, then write the final answer after 'Answer:'."


@pytest.mark.parametrize("text,expected", [
    ("37 * 5 = 185\n412 + 185 = 597\nAnswer: 597", 597),
    ("Answer: 597.", 597),
    ("answer:597", 597),                                  # any case, no space
    ("**Answer:** 1,234", 1234),                          # markdown bold; thousands commas
    ("Answer: -47", -47),
    ("Answer: 5\nwait, no.\nAnswer: 6", 6),               # the last marker counts
    ("Answer: 412 + 185 = 597", 412),                     # the first number after it
    ("The answer: it is 597 I think", 597),
    ("412 + 185 = 597", None),                            # no marker: no final answer
    ("Answer: none", None),                               # a marker with no number after it
    ("Answer: 5 ... final answer: 2.5", Decimal("2.5")),
])
def test_final_answer_by_hand(text, expected):
    assert final_answer(text) == expected


def test_reasoning_correct_and_goal_read_the_final_answer_only():
    assert answer_correct(Q, "37 * 5 = 185\n412 + 185 = 597\nAnswer: 597", 597) == 1.0
    assert answer_correct(Q, "37 * 5 = 999 (wrong working)\nAnswer: 597", 597) == 1.0   # working ignored
    assert answer_correct(Q, "412 + 185 = 597", 597) == 0.0                            # no Answer:
    assert answer_correct(Q, "Answer: 597\nthen 412 + 37 = 449", 597) == 1.0           # text after is ignored
    assert answer_correct(Q, "Answer: 597 ... Answer: 598", 597) == 0.0
    for r in ("Answer: 597", "Answer: 598", "597", ""):
        assert answer_goal(Q, r, 597) == (answer_correct(Q, r, 597) == 1.0)


@pytest.mark.parametrize("text,pays", [
    ("37 * 5 = 185\n412 + 185 = 597\nAnswer: 597", 1.0),
    ("work\nAnswer: 598.\n", 1.0),                        # right or wrong; final period and newline allowed
    ("Answer: 597 because 412 + 185", 0.0),               # something after the number
    ("Answer: 5\nAnswer: 597", 0.0),                      # the marker twice
    ("597", 0.0),                                         # no marker
    ("Answer: 412 + 185 = 597", 0.0),
])
def test_reasoning_format_by_hand(text, pays):
    assert answer_format(Q, text, 597) == pays


def test_chain_value_follows_precedence():
    assert chain_value([412, 37, 5], ["+", "*"]) == 597
    assert chain_value([2, 3, 4, 5], ["*", "-", "*"]) == 6 - 20
    assert chain_value([10, 4, 3], ["-", "-"]) == 3                # left to right
    assert chain_value([7, 8], ["-"]) == -1


def test_reasoning_task_prompts_answers_cards_and_demonstrations():
    task = load_task("rlvr.tasks.arith", ops="+-*", digits=3, operands=3, reasoning=True, heldout=20, n_train=50,
                     seed=1)
    assert task.name == "arith-add-sub-mul-3d-x3-cot" and task.max_new_tokens == 256
    assert len(task.train) == 50 and len(task.heldout) == 20
    keys = {ex.meta["expr"] for ex in task.train}
    assert len(keys) == 50 and not keys & {ex.meta["expr"] for ex in task.heldout}
    for ex in task.train + task.heldout:
        xs, ops = ex.meta["operands"], ex.meta["ops"]
        assert len(xs) == 3 and all(100 <= x <= 999 for x in xs) and set(ops) <= set("+-*")
        assert ex.prompt == f"What is {ex.meta['expr']}? Think step by step, then write the final answer after 'Answer:'."
        assert ex.answer == eval(ex.meta["expr"])                # the usual precedence  # noqa: S307
        demo = task.demonstrate(ex)
        assert answer_correct(ex.prompt, demo, ex.answer) == 1.0 and answer_format(ex.prompt, demo, ex.answer) == 1.0
        assert demo.count("\n") == 2                               # one line per operation, then the answer
    ex = task.heldout[0]
    assert task.rewards["correct"].card.exploit_example is None
    hack = task.rewards["format"].card.exploit_example(ex)
    assert answer_format(ex.prompt, hack, ex.answer) == 1.0 and not task.goal(ex.prompt, hack, ex.answer)
    two = load_task("rlvr.tasks.arith", digits=3, reasoning=True, heldout=5, n_train=5)
    assert two.name == "arith-add-3d-cot" and two.heldout[0].meta["op"] == "+"
    assert two.heldout[0].prompt.startswith(f"What is {two.heldout[0].meta['expr']}? Think step by step")
    assert load_task("rlvr.tasks.arith").max_new_tokens == 16                 # the plain form is unchanged


def test_reasoning_arguments_are_checked():
    with pytest.raises(ValueError, match="operands"):
        load_task("rlvr.tasks.arith", operands=7)
    with pytest.raises(ValueError, match="expr"):
        load_task("rlvr.tasks.arith", operands=3)                             # the default template has no {expr}
    with pytest.raises(ValueError, match="expr"):
        load_task("rlvr.tasks.arith", reasoning=True, prompt_template="{expr} = {a}?")
    with pytest.raises(ValueError, match="reasoning"):
        load_task("rlvr.tasks.arith", reasoning="yes")
    custom = load_task("rlvr.tasks.arith", operands=4, prompt_template="Compute {expr}.", heldout=3, n_train=3)
    assert custom.heldout[0].prompt == f"Compute {custom.heldout[0].meta['expr']}."


def test_reasoning_answer_from_last_reads_the_last_number():
    """answer_from="last": correct and the goal read the reply's last number (what a small chat model's
    'Answer: 7 + 5 + 8 = 20' and 'The answer is 20.' end with); the marker rule reads 7 and nothing there."""
    task = load_task("rlvr.tasks.arith", digits=1, operands=3, reasoning=True, answer_from="last", heldout=5,
                     n_train=5)
    marker = load_task("rlvr.tasks.arith", digits=1, operands=3, reasoning=True, heldout=5, n_train=5)
    assert task.name == "arith-add-1d-x3-cot-last" and [e.prompt for e in task.heldout] == [e.prompt for e in marker.heldout]
    ex = task.heldout[0]
    expr = ex.meta["expr"]
    for reply, last_pays, marker_pays in [(f"Answer: {expr} = {ex.answer}", 1.0, 0.0),
                                          (f"The answer is {ex.answer}.", 1.0, 0.0),
                                          (f"Answer: {ex.answer}", 1.0, 1.0),
                                          (f"Answer: {ex.answer}, from 3 steps", 0.0, 1.0),
                                          (f"{ex.answer + 1}", 0.0, 0.0)]:
        assert task.rewards["correct"].fn(ex.prompt, reply, ex.answer) == last_pays, reply
        assert marker.rewards["correct"].fn(ex.prompt, reply, ex.answer) == marker_pays, reply
        assert task.goal(ex.prompt, reply, ex.answer) == (last_pays == 1.0)
        assert task.rewards["format"].fn(ex.prompt, reply, ex.answer) == marker.rewards["format"].fn(ex.prompt, reply, ex.answer)
    assert "last number" in task.rewards["correct"].card.pays_for and task.rewards["correct"].card.exploit_example is None
    with pytest.raises(ValueError, match="answer_from must be one of marker, last"):
        load_task("rlvr.tasks.arith", reasoning=True, answer_from="first")
    with pytest.raises(ValueError, match="answer_from applies to reasoning"):
        load_task("rlvr.tasks.arith", answer_from="last")


def test_b_digits_sets_the_second_operand_by_hand():
    """2-digit x 1-digit: 90 x 10 = 900 problems, none the same pair twice; [1, 2]: a 2-digit number
    times 0..99, where 23 * 45 and 45 * 23 are one problem: 90 x 10 + 90 x 91 / 2 = 4995."""
    task = arith_task(ops="*", digits=2, b_digits=1, heldout=200, seed=0)
    assert task.name == "arith-mul-2d-b1d"
    everything = list(task.train) + list(task.heldout)
    assert len(task.heldout) == 200 and len(everything) == 900
    big_small = {(max(ex.meta["a"], ex.meta["b"]), min(ex.meta["a"], ex.meta["b"])) for ex in everything}
    assert big_small == {(a, b) for a in range(10, 100) for b in range(10)}
    assert all(ex.answer == ex.meta["a"] * ex.meta["b"] for ex in everything)
    both = {ex.prompt.split("?")[0] for ex in everything}
    assert any(p.startswith("What is 7 *") for p in both) and any(p.endswith("* 7") for p in both)   # either order
    wide = arith_task(ops="*", digits=2, b_digits=[1, 2], heldout=200, seed=0)
    assert wide.name == "arith-mul-2d-b1-2d" and len(wide.train) + len(wide.heldout) == 900 + 90 * 91 // 2

    def pairs(examples):
        return {(min(ex.meta["a"], ex.meta["b"]), max(ex.meta["a"], ex.meta["b"])) for ex in examples}

    assert not pairs(wide.heldout) & pairs(wide.train)
    assert [ex.prompt for ex in arith_task(ops="*", digits=2, b_digits=1, heldout=200).heldout] == \
        [ex.prompt for ex in task.heldout]                                    # seeded
    sampled = arith_task(ops="*", digits=6, b_digits=[1, 3], heldout=20, n_train=30)   # past the enumeration limit
    assert all(100_000 <= max(ex.meta["a"], ex.meta["b"]) and min(ex.meta["a"], ex.meta["b"]) <= 999
               for ex in sampled.train)
    for bad in (0, 10, [2, 1], [1], True, "1"):
        with pytest.raises(ValueError, match="b_digits must be a digit count"):
            arith_task(ops="*", b_digits=bad)
    with pytest.raises(ValueError, match="b_digits needs operands = 2"):
        arith_task(ops="*", b_digits=1, operands=3, reasoning=True)
