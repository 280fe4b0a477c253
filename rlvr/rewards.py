"""The reward contract, reward cards, and safe scoring with explicit statuses.

A reward is a deterministic program ``fn(prompt, response, answer) -> float``, or, for a process
reward, ``-> list[float]``: one score per step of the response (the task's ``step_delimiter`` cuts
the steps; "" = one per response token on fixed-length tasks). A list is scored as its mean, a
:class:`StepScores` float that keeps the steps for the per-token Δ (:func:`steps_of`).
Every reward ships with a card that names the proxy before anyone trusts an improvement on it:

* ``pays_for``: what the reward pays for;
* ``ignores``: what it does not look at;
* ``exploit``: a pattern that scores well without solving the task (and, when one can be
  written down, ``exploit_example``, a function producing such a response for an example).

Scoring never crashes the run and never hides a failure as a silent 0. :func:`score` returns
a status next to the value: ``ok``, ``error`` (the reward raised), ``none`` (it returned
None), ``nan`` (NaN or infinity), ``bad_type`` (not a real number, e.g. a string) or ``exit``
(it raised SystemExit, e.g. called ``sys.exit``). Scored through a
:class:`rlvr.reward_pool.RewardPool` (``pool=`` of :func:`score_batch` and :func:`goal_hits`),
each call also has a time and memory limit, and two more statuses exist: ``timeout`` (the call
ran past the limit; its worker was killed and replaced) and ``crashed`` (the worker process died:
``os._exit``, a signal, a segfault, the kernel's out-of-memory killer). Any status but ``ok``
gives the value 0.0, and :func:`score_batch` counts each status so the trainer can log them
every step.

Stdlib only; never imports the trainer or the config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Sequence, Union

if TYPE_CHECKING:   # rlvr.tasks imports this module
    from rlvr.tasks import Example

RewardFn = Callable[[str, str, Any], float]
"""``fn(prompt, response, answer) -> float``: deterministic, and total on any string."""

STATUSES = ("ok", "error", "none", "nan", "bad_type", "exit", "timeout", "crashed")
"""Every status :func:`score` can return, in the order logs print them."""

FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite float32: rewards are held in float32 (rlvr.rollout), so a larger value is scored as
one that is not finite (status ``nan``)."""
MAX_ERRORS_KEPT = 5
"""How many distinct failure messages one :func:`score_batch` call keeps for the log."""


@dataclass
class RewardCard:
    """Names the proxy: what it pays for, what it ignores, and how it is gamed."""

    pays_for: str
    """What a response must do to score."""
    ignores: str
    """What the reward does not look at (so training will not improve it)."""
    exploit: str
    """A pattern that scores well without solving the task, with its score."""
    exploit_example: Callable[[Example], str] | None = None
    """Builds such a response for an example; None when no exploit is known."""


@dataclass
class Reward:
    """A named reward function and its card."""

    name: str
    fn: RewardFn
    card: RewardCard
    batch_fn: Callable[[Sequence[str], Sequence[str], Sequence[Any]], Sequence[Any]] | None = None
    """Optional: scores many (prompts, responses, answers) in one call (a reward model's batched
    forward). `score_batch` uses it when set; if it raises or returns the wrong count, every
    response is scored one by one with `fn`, so each failure gets its own status."""

    def __call__(self, prompt: str, response: str, answer: Any) -> float:
        return self.fn(prompt, response, answer)


class Score(NamedTuple):
    """One scored response: ``value`` is 0.0 unless ``status == "ok"``."""

    value: float
    status: str
    detail: str = ""
    """Why the status is not ``ok``: the exception text, or the repr of the bad value."""


def guarded(call: Callable[[], Any], failed: Any, *, interrupts: bool = False) -> tuple[Any, Score | None]:
    """Run the user's code `call()` so that it never takes the run down: ``(its value, None)``, or
    ``(None, the Score of the failure)`` with value `failed`: status ``error`` for an Exception,
    ``exit`` for SystemExit. A KeyboardInterrupt (the user's Ctrl-C) propagates unless
    ``interrupts=True`` (a reward worker, which ignores Ctrl-C: there it is the code's own, ``exit``).
    The one guard of rewards, goals, tools and environment steps."""
    try:
        return call(), None
    except Exception as e:  # user code must never take the run down
        return None, Score(failed, "error", f"{type(e).__name__}: {e}")
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt) and not interrupts:
            raise
        return None, Score(failed, "exit", f"{type(e).__name__}: {e}".rstrip(": "))


def score(fn: RewardFn | Reward, prompt: str, response: str, answer: Any, *, interrupts: bool = False) -> Score:
    """Run one reward on one response without letting it crash the caller.

    ``value, status, detail = score(...)``. A reward that raises gives status ``error`` with
    ``"ExceptionType: message"`` in ``detail``; None gives ``none``; NaN or ±inf gives
    ``nan`` (as does a value beyond the float32 range, FLOAT32_MAX); anything that is not a real number (a string, a dict, a complex) gives
    ``bad_type``; a list of real numbers is a process reward (`check_value`). bools and ints count
    as numbers. SystemExit (``sys.exit`` in the reward) gives ``exit``. KeyboardInterrupt still
    stops the run (it is the user's Ctrl-C) unless ``interrupts=True``: a reward worker, which
    ignores Ctrl-C, passes it, so a KeyboardInterrupt raised by the reward's own code is status
    ``exit`` there too.
    """
    if isinstance(fn, Reward):
        fn = fn.fn
    v, failed = guarded(lambda: fn(prompt, response, answer), 0.0, interrupts=interrupts)
    return failed if failed is not None else check_value(v)


def call_tool(fn, prompt: str, response: str, answer: Any, *, interrupts: bool = False) -> Score:
    """Run a task's tool (rlvr.tools) on one response without letting it crash the caller, as
    `score` runs a reward: ``Score(text, "ok", "")`` where text is the str to insert or None (end the
    response); a tool that raises gives value None and status ``error`` (``exit`` for SystemExit,
    and for KeyboardInterrupt with ``interrupts``), one that returns anything else ``bad_type``."""
    out, failed = guarded(lambda: fn(prompt, response, answer), None, interrupts=interrupts)
    if failed is not None:
        return failed
    if out is not None and not isinstance(out, str):
        return Score(None, "bad_type", f"the tool returned a {type(out).__name__}, not a str or None")
    return Score(out, "ok", "")


class StepScores(float):
    """A process reward's value: a float equal to the mean of its per-step scores, which it keeps
    in ``steps``. Arithmetic gives plain floats, so totals, logs and JSON see the mean; read the
    steps back with :func:`steps_of` (e.g. from ``BatchScores.per_reward``)."""

    steps: tuple[float, ...]

    def __new__(cls, steps: Sequence[float]) -> "StepScores":
        steps = tuple(float(x) for x in steps)
        obj = super().__new__(cls, sum(steps) / len(steps))
        obj.steps = steps
        return obj

    def __reduce__(self):  # pickles with its steps (a worker pool may send it across processes)
        return (StepScores, (self.steps,))

    def __repr__(self) -> str:
        return f"StepScores({list(self.steps)!r})"


def steps_of(value: float) -> tuple[float, ...]:
    """The per-step scores a value carries (a :class:`StepScores`), or () for a plain number."""
    return getattr(value, "steps", ())


def check_value(v: Any) -> Score:
    """The status of one value a reward returned (see `score`).

    A list or tuple of real numbers is a process reward, one score per step of the response:
    ``ok`` with a :class:`StepScores` value (their mean, carrying the steps); an empty list or a
    non-number inside is ``bad_type``, a NaN or infinity inside is ``nan``.
    """
    if type(v) is not float:  # fast path: the usual case is a plain float
        if v is None:
            return Score(0.0, "none", "returned None")
        if isinstance(v, (str, bytes)):
            return Score(0.0, "bad_type", f"returned {type(v).__name__} {v!r:.80}")
        if isinstance(v, StepScores):
            return Score(v, "ok")
        if isinstance(v, (list, tuple)):
            return _check_steps(v)
        try:
            v = float(v)  # int, bool, numpy scalar, 1-element tensor
        except Exception:
            return Score(0.0, "bad_type", f"returned {type(v).__name__} {v!r:.80}")
    if not math.isfinite(v):
        return Score(0.0, "nan", f"returned {v}")
    if abs(v) > FLOAT32_MAX:
        return Score(0.0, "nan", f"returned {v:g}, beyond the float32 range (±{FLOAT32_MAX:.3g}) rewards are "
                                 "trained in, where it is inf")
    return Score(v, "ok")


def _check_steps(v: list | tuple) -> Score:
    """check_value for a list of per-step scores."""
    if not v:
        return Score(0.0, "bad_type", f"returned an empty {type(v).__name__}")
    steps = []
    for i, x in enumerate(v):
        one = Score(0.0, "bad_type", "a nested list") if isinstance(x, (list, tuple)) else check_value(x)
        if one.status != "ok":
            return Score(0.0, one.status, f"step {i}: {one.detail}")
        steps.append(one.value)
    return Score(StepScores(steps), "ok")


WeightedRewards = Mapping[str, tuple[Union[RewardFn, Reward], float]]
"""``{name: (fn_or_reward, weight)}``: the rewards a run optimizes and their weights."""


@dataclass
class BatchScores:
    """Rewards for a batch of responses, total and per reward, with status counts."""

    total: list[float]
    """Per response: the weighted sum of the named rewards (failed ones count 0.0)."""
    per_reward: dict[str, list[float]]
    """Per reward name, per response: the unweighted value (0.0 where not ``ok``)."""
    status_counts: dict[str, int]
    """Over all rewards and responses: how many of each status (every status present)."""
    status_by_reward: dict[str, dict[str, int]]
    """The same counts, per reward name."""
    errors: list[str] = field(default_factory=list)
    """Up to MAX_ERRORS_KEPT distinct ``"name: detail"`` messages for the log."""

    @property
    def failed(self) -> int:
        """How many (reward, response) scores were not ``ok``."""
        return sum(c for s, c in self.status_counts.items() if s != "ok")


def score_batch(
    rewards: WeightedRewards,
    prompts: Sequence[str],
    responses: Sequence[str],
    answers: Sequence[Any],
    pool: Any = None,
) -> BatchScores:
    """Score every response with every named reward; total = the weighted sum.

    ``prompts``, ``responses`` and ``answers`` are aligned, one row per response (repeat a
    prompt and its answer G times for G samples). Raises ValueError if they differ in length
    or ``rewards`` is empty; a reward that fails on a response never raises.

    ``pool``: a :class:`rlvr.reward_pool.RewardPool` runs the calls in its worker processes,
    in parallel, each with a timeout and a memory limit; the rewards are looked up there by
    name in the pool's own copy of the task, so every name of ``rewards`` must be one of the
    task's (the functions given here are not sent). None scores here, one call at a time.
    """
    n = len(responses)
    if len(prompts) != n or len(answers) != n:
        raise ValueError(
            f"score_batch: {len(prompts)} prompts, {len(responses)} responses and "
            f"{len(answers)} answers; they must be aligned, one row per response"
        )
    if not rewards:
        raise ValueError("score_batch: no rewards given")
    if pool is not None:
        scores = pool.scores(list(rewards), prompts, responses, answers)
    else:
        scores = {name: score_all(fn, prompts, responses, answers) for name, (fn, _) in rewards.items()}
    return aggregate(rewards, scores)


def score_all(fn: RewardFn | Reward, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Any],
              *, interrupts: bool = False) -> list[Score]:
    """One :class:`Score` per response: the reward's ``batch_fn`` when it has one and it works,
    else :func:`score` call by call (so each failure gets its own status)."""
    batched = _try_batch(fn, prompts, responses, answers)
    if batched is not None:
        return [check_value(v) for v in batched]
    if isinstance(fn, Reward):
        fn = fn.fn
    return [score(fn, p, r, a, interrupts=interrupts) for p, r, a in zip(prompts, responses, answers)]


def aggregate(rewards: WeightedRewards, scores: Mapping[str, Sequence[Score]]) -> BatchScores:
    """BatchScores from one list of Score per reward name: weighted totals, status counts, messages."""
    n = len(next(iter(scores.values())))
    total = [0.0] * n
    per_reward: dict[str, list[float]] = {}
    by_reward: dict[str, dict[str, int]] = {}
    errors: list[str] = []
    for name, (_, weight) in rewards.items():
        weight = float(weight)
        values = [0.0] * n
        counts = dict.fromkeys(STATUSES, 0)
        for i, (v, status, detail, *_) in enumerate(scores[name]):
            counts[status] += 1
            if status == "ok":
                values[i] = v
                total[i] += weight * v
            elif len(errors) < MAX_ERRORS_KEPT:
                msg = f"{name}: {detail}"
                if msg not in errors:
                    errors.append(msg)
        per_reward[name] = values
        by_reward[name] = counts
    status_counts = {s: sum(c[s] for c in by_reward.values()) for s in STATUSES}
    return BatchScores(total, per_reward, status_counts, by_reward, errors)


def _try_batch(reward, prompts, responses, answers) -> list | None:
    """The reward's `batch_fn` output, or None (no batch_fn, it raised, or the count is wrong)."""
    batch_fn = getattr(reward, "batch_fn", None)
    if batch_fn is None:
        return None
    try:
        out = list(batch_fn(list(prompts), list(responses), list(answers)))
    except Exception:
        return None
    return out if len(out) == len(responses) else None


def check_goal(goal: Callable[[str, str, Any], Any], prompt: str, response: str, answer: Any, *,
               interrupts: bool = False) -> Score:
    """The goal on one response as a Score: value 1.0 (met) or 0.0, status ``ok``; a goal check that
    raises is status ``error`` (``exit`` for SystemExit) with value 0.0, a miss."""
    met, failed = guarded(lambda: bool(goal(prompt, response, answer)), 0.0, interrupts=interrupts)
    return failed if failed is not None else Score(1.0 if met else 0.0, "ok")


def goal_hits(goal: Callable[[str, str, Any], Any], prompts: Sequence[str], responses: Sequence[str],
              answers: Sequence[Any], pool: Any = None) -> tuple[list[bool], int, list[str]]:
    """The task's goal on every response: (hits, failures, first messages). A goal check that fails
    (raises, exits, or, in a ``pool``, times out or kills its worker) counts as a miss and as a
    failure (reported, never silent), like a reward's non-``ok`` statuses. With a
    :class:`rlvr.reward_pool.RewardPool` the pool's task's goal runs in its workers (``goal`` is
    not sent: pass the same task's goal)."""
    if pool is not None:
        checks = pool.goals(prompts, responses, answers)
    else:
        checks = [check_goal(goal, p, r, a) for p, r, a in zip(prompts, responses, answers)]
    hits, failures, errors = [], 0, []
    for s in checks:
        hits.append(s.status == "ok" and s.value == 1.0)
        if s.status != "ok":
            failures += 1
            if len(errors) < MAX_ERRORS_KEPT:
                errors.append(f"goal: {s.detail}" if s.status in ("error", "exit") else f"goal: {s.status}: {s.detail}")
    return hits, failures, errors
