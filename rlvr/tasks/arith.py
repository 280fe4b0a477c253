"""Arithmetic in chat form: "What is 23 + 45? Reply with the number only." for pretrained chat models.

Problems
--------
``ops`` is any of ``+ - *`` (e.g. ``"+"`` or ``"+-*"``); each operand has exactly ``digits``
digits (``digits=1``: 0 to 9; ``digits=2``: 10 to 99; ...), or the second has ``b_digits``
(``digits=2, b_digits=1``: 2-digit x 1-digit; ``b_digits=[1, 2]``: x 0 to 99). Subtraction puts the larger operand
first, so every answer is a whole number >= 0. A problem is ``(op, a, b)`` with the operand pair
unordered for ``+`` and ``*`` (``23 + 45`` and ``45 + 23`` are one problem, shown in one order
drawn with the seed), so the held-out set is disjoint from train by operand pair, not only by
prompt text.

Prompts
-------
``prompt_template`` (default ``"What is {a} {op} {b}? Reply with the number only."``) gives
``Example.prompt``; ``Example.meta["messages"]`` holds it as one user message, so a Hugging Face
tokenizer with a chat template encodes it as a chat turn (``rlvr.tokenizer.encode_example``) and the
built-in character tokenizer reads the plain prompt. ``meta`` also keeps ``a``, ``op``, ``b``.

Reading a number
----------------
``numbers(text)`` finds integers and decimals, with an optional leading minus sign and ``,``
thousands separators (``"1,234"`` is 1234, ``"1,2,3"`` is 1, 2, 3); a minus sign right after a
digit is an operator (``"23-45"`` gives 23 and 45). ``last_number(text)`` is the last of them.

Rewards
-------
* ``correct``: 1.0 when the last number in the reply equals the answer (``68``, ``68.0``, ``"23 +
  45 = 68"`` and ``"It is 68."`` all score 1.0), else 0.0.
* ``format``: 1.0 when the reply is one number and nothing else (surrounding whitespace allowed),
  else 0.0; right or wrong. A small shaping term beside ``correct``:
  ``task.reward_weights = {correct = 1.0, format = 0.1}``.

The goal is exact correctness: the last number in the reply equals the answer exactly (the check
of ``correct``).

Chain of thought
----------------
``reasoning=True`` asks for working before the answer (``REASONING_TEMPLATE``: "What is {expr}?
Think step by step, then write the final answer after 'Answer:'.") and ``operands`` (2 to
``MAX_OPERANDS``) makes each problem a chain such as ``412 + 37 * 5 - 208`` (the usual precedence:
``*`` before ``+`` and ``-``, then left to right; answers may be negative). ``{expr}`` in a
template is the whole expression; a chain needs it. The rewards then read the final answer, not the
last number (``final_answer``: the first number after the reply's last ``Answer:``, any case):

* ``correct``: 1.0 when the final answer equals the answer, else 0.0 (no ``Answer:``: 0.0).
* ``format``: 1.0 when the reply holds ``Answer:`` once and ends with it and one bare number
  (``Answer: 68``, an optional final period), right or wrong; a small term beside ``correct``.

The goal is the final answer's exact correctness (the check of ``correct``). Default
``max_new_tokens`` 256: the working needs room, and a reply cut before ``Answer:`` scores 0.

``answer_from="last"`` reads the final answer as the plain task does instead: the reply's last
number, marker or not (``correct`` and the goal; ``format`` still pays for the ``Answer: N``
ending). A small chat model often ends its working with ``Answer: 7 + 5 + 8 = 20`` or ``The answer
is 20.``, which the marker rule reads as 7 or nothing: with the last number its base accuracy is
above zero, so a run has groups to learn from before it has learnt the format.

A calculator tool
-----------------
``calculator=True`` gives the task an environment (``Calculator``, rlvr.environments) and a prompt
that offers it (``CALCULATOR_TEMPLATE``): the reply may write ``<calc>23 * 45</calc>``, and the
environment inserts ``<result>1035</result>``. Run it with ``sampling.stop = ["</calc>"]`` and
``sampling.max_tool_calls`` >= 1. The calculator (``calculator_tool``, through ``calculate``) parses integers, ``+ - *`` and
parentheses (Python's ``ast``, never ``eval``), at most ``MAX_CALC_CHARS`` characters; anything
else gets ``<result>?</result>``. The rewards read the whole reply, inserted results included, so
a reply that ends right after a correct result scores 1.0: using the tool is the point. ``format``
pays only a bare number, so leave it out of calculator runs. Two more rewards read the episode:
``turns`` (the environment's reward on the final answer) and ``tool_use`` (the answer is a result the
calculator returned; its card names how tool use is gamed: the answer sent through the tool and
echoed, calls without end).
"""

from __future__ import annotations

import ast
import operator
import random
import re
import string
from decimal import Decimal

from rlvr.environments import Episode, Step, episode_of, turn_rewards
from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Example, Task, limits

DEFAULT_TEMPLATE = "What is {a} {op} {b}? Reply with the number only."
"""The prompt; ``{a}``, ``{op}`` and ``{b}`` are filled in."""
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
"""The operations and how each answer is computed."""
OP_NAMES = {"+": "add", "-": "sub", "*": "mul"}
COMMUTATIVE = frozenset("+*")
CALCULATOR_TEMPLATE = ("What is {a} {op} {b}? You may compute with <calc>expression</calc>; its result follows as "
                       "<result>value</result>. End with the number only.")
"""The prompt with ``calculator=True``."""
REASONING_TEMPLATE = "What is {expr}? Think step by step, then write the final answer after 'Answer:'."
"""The prompt with ``reasoning=True``; ``{expr}`` is the whole expression."""
MAX_OPERANDS = 6
"""Most operands in one problem (``operands``)."""
ANSWER = re.compile(r"answer\s*:", re.I)
"""The marker the final answer follows (any case; ``**Answer:**`` contains it)."""
MAX_CALC_CHARS = 64
"""Longest expression the calculator evaluates (bounds the size of any product)."""
CALC = re.compile(r"<calc>((?:(?!<calc>).)*?)</calc>", re.S)
"""A call: the text between the last ``<calc>`` and the ``</calc>`` after it."""
ENUMERATE_LIMIT = 200_000
"""Problem spaces of at most this many problems are enumerated and shuffled; larger ones are sampled."""
NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
"""An integer or decimal, optional minus, optional thousands commas; not glued to a digit or '.' before it."""


def numbers(text: str) -> list[Decimal]:
    """Every number in ``text``, in order (see the module docstring for what counts)."""
    return [Decimal(m.group().replace(",", "")) for m in NUMBER.finditer(text)]


def last_number(text: str) -> Decimal | None:
    """The last number in ``text``, or None when there is none."""
    found = numbers(text)
    return found[-1] if found else None


def correct(prompt: str, response: str, answer: int) -> float:
    """1.0 when the last number in the reply equals ``answer``, else 0.0."""
    return 1.0 if last_number(response) == answer else 0.0


def goal(prompt: str, response: str, answer: int) -> bool:
    """Exact correctness: the last number in the reply is the answer."""
    return last_number(response) == answer


def final_answer(text: str) -> Decimal | None:
    """The first number after the last ``Answer:`` (any case) in ``text``; None without a marker or a
    number after it (what counts as a number: ``numbers``)."""
    marks = list(ANSWER.finditer(text))
    if not marks:
        return None
    m = NUMBER.search(text, marks[-1].end())
    return Decimal(m.group().replace(",", "")) if m else None


def answer_correct(prompt: str, response: str, answer: int) -> float:
    """1.0 when the reply's final answer (``final_answer``) equals ``answer``, else 0.0."""
    return 1.0 if final_answer(response) == answer else 0.0


def answer_goal(prompt: str, response: str, answer: int) -> bool:
    """Exact correctness of the final answer: the first number after the reply's last ``Answer:``."""
    return final_answer(response) == answer


ANSWER_FROM = ("marker", "last")
"""Where a chain of thought's final answer is read (``answer_from``): the first number after the
last ``Answer:`` (``final_answer``), or the reply's last number (``last_number``)."""


ANSWER_LINE = re.compile(r"answer\s*:\s*" + NUMBER.pattern + r"\.?\s*\Z", re.I)
"""A reply's ending that ``answer_format`` pays for: ``Answer:``, one bare number, an optional period."""


def answer_format(prompt: str, response: str, answer: int) -> float:
    """1.0 when the reply holds ``Answer:`` once and ends with it and one bare number (an optional
    final period, whitespace around), right or wrong; else 0.0."""
    return 1.0 if len(ANSWER.findall(response)) == 1 and ANSWER_LINE.search(response) else 0.0


def format_reward(prompt: str, response: str, answer: int) -> float:
    """1.0 when the reply is a single number and nothing else (whitespace around it allowed), else 0.0."""
    return 1.0 if NUMBER.fullmatch(response.strip()) else 0.0


_CALC_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _calc_value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _CALC_OPS:
        return _CALC_OPS[type(node.op)](_calc_value(node.left), _calc_value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _calc_value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    raise ValueError(f"not integer arithmetic: {type(node).__name__}")


def calculate(expr: str) -> int | None:
    """The value of ``expr`` (integers, ``+ - *``, parentheses, at most MAX_CALC_CHARS characters),
    parsed with ``ast`` and evaluated node by node; None for anything else."""
    if len(expr) > MAX_CALC_CHARS:
        return None
    try:
        return _calc_value(ast.parse(expr.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return None


def calculator_tool(prompt: str, response: str, answer: int) -> str:
    """The task's tool: the value of the reply's last ``<calc>...</calc>`` as ``<result>N</result>``,
    ``<result>?</result>`` when it is not integer arithmetic or there is no call."""
    calls = CALC.findall(response)
    value = calculate(calls[-1]) if calls else None
    return f"<result>{'?' if value is None else value}</result>"


class Calculator:
    """The calculator as an environment (rlvr.environments): an action that ends with ``</calc>`` is a
    call, answered with ``calculator_tool``'s ``<result>N</result>`` (no reward); any other action is the
    final answer, which ends the episode with reward 1.0 when its last number (or, with none, the last
    result the calculator gave) is the answer, else 0.0 (the check of ``correct``)."""

    def reset(self, prompt: str, answer: int) -> None:
        self.prompt, self.answer, self.last = prompt, answer, None

    def step(self, action: str) -> Step:
        if action.rstrip().endswith("</calc>"):
            result = calculator_tool(self.prompt, action, self.answer)
            self.last = last_number(result) if result != "<result>?</result>" else self.last
            return Step(result, None, False)
        final = last_number(action)
        return Step(None, 1.0 if (self.last if final is None else final) == self.answer else 0.0, True)


def calculator_results(episode: Episode) -> list[Decimal]:
    """The numbers the calculator returned in ``episode`` (its inserted observations, not text the policy
    wrote that looks like a result)."""
    return [v for obs in episode.observations if obs for v in [last_number(obs)] if v is not None]


def tool_use(prompt: str, response: str, answer: int) -> float:
    """1.0 when the episode's final answer (the last number of the reply) is a result the calculator
    returned in it, else 0.0 (a plain response, without an episode: 0.0)."""
    ep = episode_of(response)
    return 1.0 if ep is not None and last_number(response) in calculator_results(ep) else 0.0


def tool_use_exploit(ex: Example) -> Episode:
    """A wrong answer sent through the calculator and echoed: ``<calc>W</calc><result>W</result>W``,
    W the answer plus one."""
    w = ex.answer + 1
    call, result = f"<calc>{w}</calc>", f"<result>{w}</result>"
    return Episode(f"{call}{result}{w}", [call, str(w)], [result, None], [None, 0.0], [(0, 1), (2, 3)], True)


def calculator_rewards() -> dict[str, Reward]:
    """The calculator task's rewards that read the episode: ``turns`` (the environment's reward on the
    final answer, a process reward) and ``tool_use`` (the answer came out of the calculator), with the
    card that names how tool use is gamed."""
    return {
        "turns": Reward("turns", turn_rewards, RewardCard(
            pays_for="the final answer's turn: 1.0 when its last number (or, with none, the calculator's last "
                     "result) equals the answer; calls earn nothing by themselves",
            ignores="how many calls were made and what they computed",
            exploit="none known that fails the goal: it is the goal's check on the final turn",
            exploit_example=None)),
        "tool_use": Reward("tool_use", tool_use, RewardCard(
            pays_for="a final answer equal to a result the calculator returned in the episode (read from the "
                     "environment's observations, so a '<result>' the policy writes itself does not count)",
            ignores="whether the call computed the prompt's problem, whether the answer is right, and how "
                    "many calls were made",
            exploit="tool use is gamed two ways. Calling the tool with the answer copied in: the calculator "
                    "echoes any number ('<calc>W</calc>' returns W), so sending a guess or a number copied from "
                    "the prompt and repeating the result scores 1.0 with the goal failed. Calling it forever: "
                    "calls cost nothing here, so a policy may call until sampling.max_tool_calls on every reply "
                    "(a reward paid per call would be farmed to that bound); watch tool_calls_per_response. "
                    "Use it beside correct, never alone",
            exploit_example=tool_use_exploit)),
    }


def demonstrate(example: Example) -> str:
    """The worked reply to an arith prompt, for ``rlvr sft``: the number only."""
    return str(example.answer)


def demonstrate_calculator(example: Example) -> list[dict]:
    """The worked reply with the calculator, for ``rlvr sft``: a call, the tool's result (a ``tool`` turn,
    inserted as rlvr.tools inserts it), then the number."""
    m = example.meta
    return [{"role": "assistant", "content": f"<calc>{m['a']} {m['op']} {m['b']}</calc>"},
            {"role": "tool", "content": f"<result>{example.answer}</result>"},
            {"role": "assistant", "content": str(example.answer)}]


def demonstrate_reasoning(example: Example) -> str:
    """The worked reply to a chain-of-thought prompt, for ``rlvr sft``: each product, then each sum or
    difference left to right, one line each, then ``Answer: N``."""
    vals, ops = list(example.meta["operands"]), list(example.meta["ops"])
    lines = []
    for want in ("*", "+-"):
        i = 0
        while i < len(ops):
            if ops[i] in want:
                v = OPS[ops[i]](vals[i], vals[i + 1])
                lines.append(f"{vals[i]} {ops[i]} {vals[i + 1]} = {v}")
                vals[i:i + 2], ops[i:i + 1] = [v], []
            else:
                i += 1
    return "\n".join(lines + [f"Answer: {example.answer}"])


def chain_value(operands: list[int], ops: list[str]) -> int:
    """``operands[0] ops[0] operands[1] ...`` with ``*`` before ``+`` and ``-``, then left to right."""
    terms, signs = [operands[0]], [1]                         # the sum's terms, products folded in
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def _chains(ops: str, digits: int, n: int, need: int, rng: random.Random) -> list[tuple]:
    """``need`` distinct chains of ``n`` operands, ``(op_1, ..., op_{n-1}, x_1, ..., x_n)``, drawn with ``rng``."""
    nums = _operand_range(digits)
    space = len(nums) ** n * len(ops) ** (n - 1)
    if need > space // 2:
        raise ValueError(f"arith_task: {need} problems is more than half of the {space} chains of {n} "
                         f"{digits}-digit operands with ops={ops!r}; ask for fewer")
    chosen: dict[tuple, None] = {}                            # an insertion-ordered set
    while len(chosen) < need:
        chosen.setdefault(tuple(rng.choice(ops) for _ in range(n - 1)) + tuple(rng.choice(nums) for _ in range(n)))
    return list(chosen)


def _check_reasoning_args(operands: int, reasoning: bool, prompt_template: str) -> None:
    if not isinstance(reasoning, bool):
        raise ValueError(f"arith_task: reasoning must be true or false, got {reasoning!r}")
    if isinstance(operands, bool) or not isinstance(operands, int) or not 2 <= operands <= MAX_OPERANDS:
        raise ValueError(f"arith_task: operands must be an int from 2 to {MAX_OPERANDS}, got {operands!r}")
    fields = {f for _, f, _, _ in string.Formatter().parse(prompt_template) if f is not None}
    if fields != {"expr"} and (operands > 2 or "expr" in fields):
        raise ValueError(f"arith_task: a template with {{expr}} uses no other field, and {operands} operands "
                         f"need {{expr}}, got {prompt_template!r}")


def _operand_range(digits: int) -> range:
    return range(0, 10) if digits == 1 else range(10 ** (digits - 1), 10 ** digits)


def _canonical(op: str, a: int, b: int) -> tuple[str, int, int]:
    """One key per problem: the larger operand first for '-', the pair sorted for '+' and '*'."""
    return (op, max(a, b), min(a, b)) if op == "-" else (op, min(a, b), max(a, b))


def _problems(ops: str, digits: int, need: int, rng: random.Random) -> list[tuple[str, int, int]]:
    """``need`` distinct problems (canonical keys) in a seeded random order."""
    nums = _operand_range(digits)
    n = len(nums)
    per_op = n * (n + 1) // 2                                # unordered pairs with repeats, and a >= b for '-'
    space = per_op * len(ops)
    if need > space:
        raise ValueError(f"arith_task: {need} problems asked for, but ops={ops!r} with {digits}-digit operands "
                         f"have only {space}")
    if space <= ENUMERATE_LIMIT:
        keys = [_canonical(op, nums[i], nums[j]) for op in ops for i in range(n) for j in range(i, n)]
        rng.shuffle(keys)
        return keys[:need]
    if need > space // 2:
        raise ValueError(f"arith_task: {need} problems is more than half of the {space} possible; ask for fewer")
    chosen: dict[tuple[str, int, int], None] = {}            # an insertion-ordered set
    while len(chosen) < need:
        chosen.setdefault(_canonical(rng.choice(ops), rng.choice(nums), rng.choice(nums)), None)
    return list(chosen)


def _b_range(b_digits: int | list[int]) -> list[int]:
    """The second operand's values for ``b_digits``: ``k`` -> the k-digit numbers, ``[lo, hi]`` -> every
    number of lo to hi digits (``[1, 2]``: 0 to 99)."""
    spec = [b_digits, b_digits] if isinstance(b_digits, int) and not isinstance(b_digits, bool) else b_digits
    if (not isinstance(spec, (list, tuple)) or len(spec) != 2
            or any(isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= 9 for d in spec) or spec[0] > spec[1]):
        raise ValueError(f"arith_task: b_digits must be a digit count from 1 to 9 or a list [lo, hi] of them, "
                         f"got {b_digits!r}")
    return [x for d in range(spec[0], spec[1] + 1) for x in _operand_range(d)]


def _mixed_space(ops: str, nums: range, b_nums: list[int]) -> int:
    """How many distinct problems `_mixed_problems` can draw (an upper bound past ENUMERATE_LIMIT)."""
    bound = len(nums) * len(b_nums) * len(ops)
    if bound > ENUMERATE_LIMIT:
        return bound
    return len({_canonical(op, a, b) for op in ops for a in nums for b in b_nums})


def _mixed_problems(ops: str, digits: int, b_nums: list[int], need: int,
                    rng: random.Random) -> list[tuple[str, int, int]]:
    """``need`` distinct problems with a ``digits``-digit first operand and a second from ``b_nums``
    (canonical keys, so ``7 * 45`` and ``45 * 7`` stay one problem), in a seeded random order."""
    nums = _operand_range(digits)
    bound = len(nums) * len(b_nums) * len(ops)
    if bound <= ENUMERATE_LIMIT:
        keys = list(dict.fromkeys(_canonical(op, a, b) for op in ops for a in nums for b in b_nums))
        if need > len(keys):
            raise ValueError(f"arith_task: {need} problems asked for, but these operands have only {len(keys)}")
        rng.shuffle(keys)
        return keys[:need]
    if need > bound // 4:
        raise ValueError(f"arith_task: {need} problems is too many of the {bound} possible; ask for fewer")
    chosen: dict[tuple[str, int, int], None] = {}
    while len(chosen) < need:
        chosen.setdefault(_canonical(rng.choice(ops), rng.choice(nums), rng.choice(b_nums)), None)
    return list(chosen)


def _check_args(ops: str, digits: int, heldout: int, n_train: int | None, prompt_template: str) -> None:
    if not isinstance(ops, str) or not ops or any(c not in OPS for c in ops) or len(set(ops)) != len(ops):
        raise ValueError(f"arith_task: ops must be distinct characters of {''.join(OPS)!r}, got {ops!r}")
    for k, v in (("digits", digits), ("heldout", heldout)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"arith_task: {k} must be a positive int, got {v!r}")
    if digits > 9:
        raise ValueError(f"arith_task: digits must be at most 9, got {digits}")
    if n_train is not None and (isinstance(n_train, bool) or not isinstance(n_train, int) or n_train < 1):
        raise ValueError(f"arith_task: n_train must be None or a positive int, got {n_train!r}")
    fields = {f for _, f, _, _ in string.Formatter().parse(prompt_template) if f is not None}
    if not {"a", "b"} <= fields or not fields <= {"a", "b", "op"}:
        raise ValueError(f"arith_task: prompt_template must use {{a}} and {{b}} (and may use {{op}}) and no other "
                         f"field, got {prompt_template!r}")
    if len(ops) > 1 and "op" not in fields:
        raise ValueError(f"arith_task: with several ops the prompt_template must show {{op}}, got {prompt_template!r}")
    limits.check_count("arith_task", "heldout", heldout)
    if n_train is not None:
        limits.check_count("arith_task", "n_train", n_train)


def arith_task(ops: str = "+", digits: int = 2, n_train: int | None = None, heldout: int = 200, seed: int = 0,
               prompt_template: str | None = None, max_new_tokens: int | None = None, calculator: bool = False,
               operands: int = 2, reasoning: bool = False, b_digits: int | list[int] | None = None,
               answer_from: str = "marker") -> Task:
    """The arithmetic task: ``a op b`` for ``op`` in ``ops`` and ``digits``-digit operands.

    ``prompt_template`` None: ``DEFAULT_TEMPLATE``, or ``CALCULATOR_TEMPLATE`` with ``calculator``
    (the calculator tool, module docstring), or ``REASONING_TEMPLATE`` with ``reasoning`` (chain of
    thought: the rewards read the final answer after ``Answer:``). ``operands`` > 2: chains of that
    many operands, each op drawn from ``ops`` (the template must use ``{expr}``). ``max_new_tokens``
    None: 256 with ``reasoning``, else 16. ``b_digits`` (two operands only): the second operand's digit
    count, or ``[lo, hi]`` for a range of counts (``digits=2, b_digits=1``: 2-digit x 1-digit;
    ``b_digits=[1, 2]``: x 0 to 99); None = ``digits`` like the first. ``answer_from`` (with
    ``reasoning``; ``ANSWER_FROM``): "marker" reads the final answer after the last ``Answer:``,
    "last" the reply's last number (the module docstring, "Chain of thought").

    ``heldout`` problems are drawn first with ``random.Random(seed)``, then ``n_train`` more for
    train (None = every remaining problem when the space is enumerated, else 100,000 or half the
    space, whichever is smaller). The same arguments always give the same task.
    """
    if prompt_template is None:
        prompt_template = (CALCULATOR_TEMPLATE if calculator else REASONING_TEMPLATE if reasoning
                           else DEFAULT_TEMPLATE)
    if max_new_tokens is None:
        max_new_tokens = 256 if reasoning else 16
    if not isinstance(calculator, bool):
        raise ValueError(f"arith_task: calculator must be true or false, got {calculator!r}")
    _check_reasoning_args(operands, reasoning, prompt_template)
    if answer_from not in ANSWER_FROM:
        raise ValueError(f"arith_task: answer_from must be one of {', '.join(ANSWER_FROM)}, got {answer_from!r}")
    if answer_from != "marker" and not reasoning:
        raise ValueError("arith_task: answer_from applies to reasoning = true (the plain task reads the last number)")
    expr = "{expr}" in prompt_template                       # checked just above; the rest as for {a} {op} {b}
    _check_args(ops, digits, heldout, n_train, DEFAULT_TEMPLATE if expr else prompt_template)
    if b_digits is not None and operands != 2:
        raise ValueError(f"arith_task: b_digits needs operands = 2, got operands = {operands}")
    b_nums = None if b_digits is None else _b_range(b_digits)
    rng = random.Random(seed)
    nums = _operand_range(digits)
    space = (len(nums) * (len(nums) + 1) // 2 * len(ops) if operands == 2 and b_nums is None
             else _mixed_space(ops, nums, b_nums) if b_nums is not None
             else len(nums) ** operands * len(ops) ** (operands - 1))
    if n_train is None:
        n_train = (space - heldout if space <= ENUMERATE_LIMIT and operands == 2
                   else min(100_000, space // 2 - heldout))
        if n_train < 1:
            raise ValueError(f"arith_task: heldout={heldout} leaves no training problems out of {space}")
    keys = (_mixed_problems(ops, digits, b_nums, heldout + n_train, rng) if b_nums is not None
            else _problems(ops, digits, heldout + n_train, rng) if operands == 2
            else _chains(ops, digits, operands, heldout + n_train, rng))

    def example(key: tuple) -> Example:
        if operands == 2:
            op, a, b = key
            if op in COMMUTATIVE and rng.random() < 0.5:     # show one of the two orders
                a, b = b, a
            chain_ops, xs = [op], [a, b]
        else:
            chain_ops, xs = list(key[:operands - 1]), list(key[operands - 1:])
        text = " ".join(f"{x} {o}" for x, o in zip(xs, chain_ops)) + f" {xs[-1]}"
        prompt = prompt_template.format(expr=text) if expr else prompt_template.format(a=xs[0], op=chain_ops[0],
                                                                                      b=xs[1])
        meta = {"messages": [{"role": "user", "content": prompt}], "operands": xs, "ops": chain_ops, "expr": text}
        if operands == 2:
            meta.update(a=xs[0], op=chain_ops[0], b=xs[1])
        return Example(prompt=prompt, answer=chain_value(xs, chain_ops), meta=meta)

    last = answer_from == "last"
    rewards = reasoning_rewards(last) if reasoning else answer_rewards()
    if calculator:
        rewards.update(calculator_rewards())
    held = [example(k) for k in keys[:heldout]]
    train = [example(k) for k in keys[heldout:]]
    name = (f"arith-{'-'.join(OP_NAMES[o] for o in ops)}-{digits}d" + (f"-x{operands}" if operands > 2 else "")
            + ("" if b_digits is None else f"-b{'-'.join(map(str, [b_digits] if isinstance(b_digits, int) else b_digits))}d")
            + ("-cot" if reasoning else "") + ("-last" if last else ""))
    return Task(name=name, train=train, heldout=held, rewards=rewards,
                goal=answer_goal if reasoning and not last else goal,
                max_new_tokens=max_new_tokens, environment=Calculator if calculator else None,
                demonstrate=(demonstrate_calculator if calculator else demonstrate_reasoning if reasoning
                             else demonstrate))


def format_exploit(ex: Example) -> str:
    """A bare number that is wrong: the answer plus one."""
    return str(ex.answer + 1)


def answer_rewards() -> dict[str, Reward]:
    """The rewards of the plain (no chain of thought) task: `correct` (the last number equals the answer)
    and `format` (the reply is one number)."""
    return {
        "correct": Reward("correct", correct, RewardCard(
            pays_for="a reply whose last number (integer or decimal, optional minus and thousands commas) "
                     "equals the answer exactly",
            ignores="everything before the last number: wrong working, repeated operands, chatter, and "
                    "whether the reply is only a number",
            exploit="none known that fails the goal: it is the goal's own check. A reply that states a wrong "
                    "answer and then the right one ('78, no, 68') scores 1.0, and so passes the goal too",
            exploit_example=None,
        )),
        "format": Reward("format", format_reward, RewardCard(
            pays_for="a reply that is one number and nothing else (whitespace around it allowed)",
            ignores="whether the number is right",
            exploit="any bare number scores the full 1.0 with the goal failed, e.g. the answer plus one; "
                    "keep its weight small beside correct",
            exploit_example=format_exploit,
        )),
    }


def reasoning_rewards(last: bool = False) -> dict[str, Reward]:
    """The chain-of-thought form's rewards (``reasoning=True``), each with its card; ``last``
    (``answer_from="last"``): ``correct`` reads the reply's last number, not the marker's."""
    def format_exploit(ex: Example) -> str:
        """A bare final answer that is wrong, with no working: the answer plus one."""
        return f"Answer: {ex.answer + 1}"

    right = Reward("correct", correct, RewardCard(
        pays_for="a reply whose last number (integer or decimal, optional minus and thousands commas) equals "
                 "the answer exactly, after 'Answer:' or not",
        ignores="the working before the last number, right or wrong, and its length; whether the reply writes "
                "'Answer:' at all",
        exploit="none that fails the goal: it is the goal's own check. The working is not checked, so the right "
                "number alone scores 1.0; a reply that ends with its working's last step ('so 12 + 8 = 20') is "
                "scored on that step's result, and one that writes the answer and then a further number ('20, "
                "from 3 steps') on the further number",
        exploit_example=None,
    ))
    return {
        "correct": right if last else Reward("correct", answer_correct, RewardCard(
            pays_for="a reply whose final answer, the first number after its last 'Answer:' (any case), equals "
                     "the answer exactly",
            ignores="the working before 'Answer:', right or wrong, and its length; every 'Answer:' but the "
                    "last; anything after the final answer's number",
            exploit="none that fails the goal: it is the goal's own check. The working is not checked, so a "
                    "reply of 'Answer: N' alone with the right N scores 1.0; hedging with several 'Answer:' "
                    "lines is scored on the last; 'Answer: 412 + 37 = 449' reads 412 (write the number alone)",
            exploit_example=None,
        )),
        "format": Reward("format", answer_format, RewardCard(
            pays_for="a reply that holds 'Answer:' once and ends with it and one bare number (an optional "
                     "final period)",
            ignores="whether the number is right, and whether there is any working before it",
            exploit="'Answer: N' alone with any N scores the full 1.0 with the goal failed, e.g. the answer "
                    "plus one; keep its weight small beside correct",
            exploit_example=format_exploit,
        )),
    }


TASK = arith_task
"""``load_task("rlvr.tasks.arith", ops="+-", digits=1)``: the callable form, parameterized by kwargs."""
