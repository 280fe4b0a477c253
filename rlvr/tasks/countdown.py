"""Countdown: reach the target with + - * / over the given numbers, each used exactly once.

The rule
--------
Every given number is used **exactly once** (the TinyZero / Countdown-Tasks-3to4 rule; pass
``use_all=False`` for "at most once"). Only ``+ - * /`` between integer literals and
parentheses are allowed; ``/`` is exact (rational) division, so ``(7-1)/4*2`` is 3. Unary
minus and unary plus are rejected (the numbers are positive and subtraction is enough; a
unary minus would let ``-a - -b`` tricks change the usage count).

Prompts (``style``)
-------------------
* ``compact`` (default, for the built-in character model): ``"25,5,4 80="``; the response is
  the bare expression, e.g. ``"(25-5)*4"``. The task gives an explicit alphabet.
* ``instruct`` (for real tokenizers): an English instruction asking for the expression inside
  ``<answer>...</answer>``; ``alphabet=None``.

Extracting the expression from a response
-----------------------------------------
1. If the response has ``<answer>...</answer>``, the content of the **last** one; otherwise the
   last non-empty line of the response.
2. If that text contains ``=``, its parts split on ``=`` are tried in order and the first that
   contains an operator is kept (``"(25-5)*4 = 80"`` and ``"80 = (25-5)*4"`` both give
   ``(25-5)*4``); with no operator anywhere, the first part.

Verification (no ``eval``)
--------------------------
The text must hold only digits, ``+-*/()`` and spaces (this rejects names, calls, strings,
``_`` in literals, ``1e3``, ``0x10``) and be at most ``MAX_EXPR_CHARS`` long; it is parsed with
``ast.parse(mode="eval")``; every node must be a BinOp with Add/Sub/Mult/Div or an int
Constant (so ``**``, ``//``, ``%`` and unary operators are rejected); the multiset of
literals must equal the given numbers (``use_all``) or fit inside them; the tree is then
evaluated by hand with :class:`fractions.Fraction` (division by zero → invalid).

Rewards
-------
* ``correct``: 1.0 when the expression is valid, obeys the number rule and equals the target.
  The goal.
* ``format``: 1.0 for a valid expression that obeys the number rule (any value), 0.5 for an
  allowed-syntax expression with the wrong numbers (or a division by zero), 0.0 otherwise.
  Meant as a small shaping term beside ``correct`` (``task.reward_weights``).

Both also work as rewards of a :mod:`rlvr.tasks.dataset` task over a file of Countdown rows
(``answer_column=None`` and columns ``nums``/``numbers`` and ``target``): they read the
instance from the answer or from ``meta``.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Example, Task, TaskError, limits
from rlvr.tasks.answers import Answer, unwrap

__all__ = ["countdown_task", "check", "verify", "extract_expression", "correct", "format_reward",
           "Verdict", "generate_instance"]

MAX_EXPR_CHARS = 200
"""Longer expression texts are invalid without parsing (bounds the parser's work)."""
ALLOWED_CHARS = frozenset("0123456789+-*/() \t")
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
COMPACT_ALPHABET = "0123456789+-*/(), ="
"""Characters of the compact prompts and of every expression."""


@dataclass(frozen=True)
class Verdict:
    """What the verifier found: ``syntax_ok`` (allowed grammar), ``uses_ok`` (number rule),
    ``value`` (None when not evaluable), ``reason`` (why it fails, '' when it is correct)."""

    syntax_ok: bool
    uses_ok: bool
    value: Fraction | None
    reason: str
    correct: bool


def extract_expression(response: str) -> str:
    """The expression part of a response (see the module doc); '' when there is none."""
    found = _ANSWER_RE.findall(response)
    if found:
        text = found[-1]
    else:
        lines = [ln for ln in response.splitlines() if ln.strip()]
        text = lines[-1] if lines else ""
    if "=" in text:
        parts = text.split("=")
        text = next((p for p in parts if any(op in p for op in "+-*/")), parts[0])
    return text.strip()


def _walk(node: ast.AST, literals: list[int]) -> None:
    """Check the grammar; collect the int literals. Raises ValueError naming the first offence."""
    if isinstance(node, ast.BinOp):
        if type(node.op) not in _OPS:
            raise ValueError(f"operator {type(node.op).__name__} is not allowed (only + - * /)")
        _walk(node.left, literals)
        _walk(node.right, literals)
    elif isinstance(node, ast.Constant):
        if type(node.value) is not int:  # bool, float, complex, str...
            raise ValueError(f"literal {node.value!r} is not a whole number")
        literals.append(node.value)
    elif isinstance(node, ast.UnaryOp):
        raise ValueError("unary operators are not allowed")
    else:
        raise ValueError(f"{type(node).__name__} is not allowed")


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    a, b = _value(node.left), _value(node.right)  # type: ignore[attr-defined]
    op = type(node.op)  # type: ignore[attr-defined]
    if op is ast.Add:
        return a + b
    if op is ast.Sub:
        return a - b
    if op is ast.Mult:
        return a * b
    if b == 0:
        raise ZeroDivisionError("division by zero")
    return a / b


def check(expr: str, numbers, target, *, use_all: bool = True) -> Verdict:
    """Verify the expression text (already extracted) against one instance. Never raises."""
    numbers = [int(x) for x in numbers]
    if not expr.strip():
        return Verdict(False, False, None, "empty expression", False)
    if len(expr) > MAX_EXPR_CHARS:
        return Verdict(False, False, None, f"longer than {MAX_EXPR_CHARS} characters", False)
    bad = sorted(set(expr) - ALLOWED_CHARS)
    if bad:
        return Verdict(False, False, None, f"characters not allowed: {''.join(bad)!r}", False)
    try:
        tree = ast.parse(expr.strip(), mode="eval")
        literals: list[int] = []
        _walk(tree.body, literals)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return Verdict(False, False, None, f"not an allowed expression: {e}", False)
    used, given = Counter(literals), Counter(numbers)
    if use_all:
        uses_ok = used == given
    else:
        uses_ok = not (used - given)
    try:
        value = _value(tree.body)
    except ZeroDivisionError:
        return Verdict(True, uses_ok, None, "division by zero", False)
    except RecursionError:
        return Verdict(False, uses_ok, None, "too deeply nested", False)
    if not uses_ok:
        extra, missing = used - given, given - used
        why = []
        if extra:
            why.append(f"uses {sorted(extra.elements())} beyond the given numbers")
        if missing and use_all:
            why.append(f"does not use {sorted(missing.elements())}")
        return Verdict(True, False, value, "; ".join(why), False)
    if value != Fraction(target):
        return Verdict(True, True, value, f"equals {value}, not {target}", False)
    return Verdict(True, True, value, "", True)


def verify(expr: str, numbers, target, *, use_all: bool = True) -> bool:
    """True when ``expr`` is a valid Countdown solution for (numbers, target)."""
    return check(expr, numbers, target, use_all=use_all).correct


def _instance(answer: Any, meta: dict | None) -> tuple[list[int], int, bool]:
    """(numbers, target, use_all) from an Answer's meta, a ``meta=`` dict or a dict answer."""
    value, inner = unwrap(answer)
    for src in (inner, meta or {}, value if isinstance(value, dict) else {}):
        nums = src.get("numbers", src.get("nums"))
        if nums is not None and "target" in src:
            return [int(x) for x in nums], int(src["target"]), bool(src.get("use_all", True))
    raise ValueError("countdown reward: the answer/meta has no numbers (or nums) and target")


def correct(prompt: str, response: str, answer: Any, meta: dict | None = None) -> float:
    """1.0 when the extracted expression reaches the target obeying the number rule, else 0.0."""
    numbers, target, use_all = _instance(answer, meta)
    return 1.0 if check(extract_expression(response), numbers, target, use_all=use_all).correct else 0.0


def format_reward(prompt: str, response: str, answer: Any, meta: dict | None = None) -> float:
    """1.0 valid expression obeying the number rule (any value); 0.5 allowed syntax otherwise; 0.0."""
    numbers, target, use_all = _instance(answer, meta)
    v = check(extract_expression(response), numbers, target, use_all=use_all)
    if v.syntax_ok and v.uses_ok and v.value is not None:
        return 1.0
    return 0.5 if v.syntax_ok else 0.0


def goal(prompt: str, response: str, answer: Any) -> bool:
    """The real target: a valid expression equal to the target (``correct`` == 1)."""
    try:
        return correct(prompt, response, answer) == 1.0
    except ValueError:
        return False


def generate_instance(rng: random.Random, n: int, low: int, high: int, max_target: int,
                      tries: int = 1000) -> tuple[list[int], int, str]:
    """(numbers, target, a solution) with 1 <= target <= max_target, built from a random
    expression tree over all n numbers (divisions exact at every step)."""
    for _ in range(tries):
        numbers = [rng.randint(low, high) for _ in range(n)]
        items = [(x, str(x)) for x in numbers]  # ints: every division below is exact
        while len(items) > 1:
            i, j = rng.sample(range(len(items)), 2)
            (a, sa), (b, sb) = items[i], items[j]
            op = rng.choice("+-*/" if b != 0 and a % b == 0 else "+-*")
            v = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b
            items = [it for k, it in enumerate(items) if k != i and k != j] + [(v, f"({sa}{op}{sb})")]
        value, text = items[0]
        if 1 <= value <= max_target:
            return numbers, value, text[1:-1]
    raise TaskError(f"countdown: no solvable instance with target in [1, {max_target}] "
                    f"found in {tries} tries (n={n}, numbers in [{low}, {high}])")


def _prompt(numbers: list[int], target: int, style: str, use_all: bool) -> str:
    if style == "compact":
        return f"{','.join(map(str, numbers))} {target}="
    rule = "exactly once" if use_all else "at most once"
    return (
        f"Using the numbers {numbers}, write an arithmetic expression that equals {target}. "
        f"Use each number {rule}, with only + - * / and parentheses. "
        "Put the expression alone inside <answer></answer>, for example <answer>(1 + 2) * 3</answer>."
    )


def _check_options(n: int, low: int, high: int, max_target: int, train: int, heldout: int,
                   style: str) -> None:
    """TaskError naming the first bad option of :func:`countdown_task`."""
    for k, v in (("n", n), ("low", low), ("high", high), ("max_target", max_target),
                 ("train", train), ("heldout", heldout)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TaskError(f"countdown: {k} must be an int, got {v!r}")
    if n < 2:
        raise TaskError(f"countdown: n must be at least 2, got {n}")
    if not 1 <= low <= high:
        raise TaskError(f"countdown: need 1 <= low <= high, got low={low}, high={high}")
    if train < 1 or heldout < 1 or max_target < 1:
        raise TaskError("countdown: train, heldout and max_target must be positive")
    if style not in ("compact", "instruct"):
        raise TaskError(f"countdown: style must be 'compact' or 'instruct', got {style!r}")
    try:  # sizes (rlvr.tasks.limits), before anything is drawn: n numbers of high's width and a separator each
        width = len(str(high)) if high < 10**4096 else limits.MAX_PROMPT_CHARS
        limits.check_length("countdown", "n", n, n * (width + 1) + len(str(max_target)) if max_target < 10**4096
                            else limits.MAX_PROMPT_CHARS + 1)
        limits.check_count("countdown", "train", train)
        limits.check_count("countdown", "heldout", heldout)
    except ValueError as e:
        raise TaskError(str(e)) from None


def _draw_examples(rng: random.Random, want: int, n: int, low: int, high: int, max_target: int,
                   style: str, use_all: bool) -> list[Example]:
    """``want`` examples with distinct prompts, in the order drawn."""
    seen: dict[str, Example] = {}
    misses = 0
    while len(seen) < want:
        numbers, target, sol = generate_instance(rng, n, low, high, max_target)
        p = _prompt(numbers, target, style, use_all)
        if p in seen:
            misses += 1
            if misses > 20 * want + 1000:
                raise TaskError(f"countdown: only {len(seen)} distinct instances found, asked for {want}; "
                                "widen [low, high] or max_target, or ask for fewer")
            continue
        meta = {"numbers": numbers, "target": target, "use_all": use_all}
        seen[p] = Example(prompt=p, answer=Answer(sol, meta), meta=dict(meta, solution=sol))
    return list(seen.values())


def _rewards(use_all: bool) -> dict[str, Reward]:
    """The ``correct`` and ``format`` rewards with their cards, for this number rule."""

    def format_exploit(ex: Example) -> str:
        """All numbers joined by + (or -, * if that happens to hit the target): valid, wrong."""
        nums = ex.answer.meta["numbers"]
        for op in "+*-":
            s = op.join(map(str, nums))
            if not verify(s, nums, ex.answer.meta["target"], use_all=use_all):
                return s
        return "+".join(map(str, nums))  # unreachable: a-b-c... < a+b+c... for positive numbers

    rule = "exactly once" if use_all else "at most once"
    return {
        "correct": Reward("correct", correct, RewardCard(
            pays_for=f"an expression (see extract_expression) over the given numbers, each used {rule}, "
                     "with only + - * / and parentheses, whose exact rational value is the target",
            ignores="how close a wrong expression gets and anything outside the extracted expression "
                    "(reasoning, extra lines before the last one)",
            exploit="none known: it is the goal on every string (the verifier parses with ast, never "
                    "eval, and rejects names, calls, powers, unary operators and reused numbers). Its "
                    "failure is sparsity: few random expressions hit the target",
            exploit_example=None,
        )),
        "format": Reward("format", format_reward, RewardCard(
            pays_for=f"a well-formed expression using the given numbers {rule} (1.0), or allowed "
                     "syntax with the wrong numbers (0.5)",
            ignores="the target: the value of the expression is never compared",
            exploit="any valid expression that misses the target, e.g. all numbers joined by '+', "
                    "scores the full 1.0 with the goal failed",
            exploit_example=format_exploit,
        )),
    }


def countdown_task(
    n: int = 3,
    low: int = 1,
    high: int = 20,
    max_target: int = 100,
    train: int = 10_000,
    heldout: int = 500,
    seed: int = 0,
    style: str = "compact",
    use_all: bool = True,
    max_new_tokens: int | None = None,
) -> Task:
    """Countdown instances drawn with ``random.Random(seed)``: ``heldout`` distinct prompts, then
    ``train`` more distinct ones (never equal to a held-out prompt). Same arguments, same task.

    ``max_new_tokens`` defaults to the longest fully parenthesised expression (compact) or 256
    (instruct). The answer is an :class:`~rlvr.tasks.dataset.Answer` whose ``str`` is one
    solution and whose ``meta`` holds ``numbers``, ``target``, ``use_all``.
    """
    _check_options(n, low, high, max_target, train, heldout, style)
    examples = _draw_examples(random.Random(seed), heldout + train, n, low, high, max_target, style, use_all)
    if max_new_tokens is None:
        max_new_tokens = n * len(str(high)) + 3 * (n - 1) if style == "compact" else 256
    return Task(
        name=f"countdown-{n}" if style == "compact" else f"countdown-{n}-instruct",
        train=examples[heldout:],
        heldout=examples[:heldout],
        rewards=_rewards(use_all),
        goal=goal,
        max_new_tokens=max_new_tokens,
        alphabet=COMPACT_ALPHABET if style == "compact" else None,
        fixed_length=False,
    )


TASK = countdown_task
