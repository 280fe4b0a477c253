"""`rlvr audit`: name the proxy, then check whether the reward pays strategies that do not solve the task.

Three things should be written down before any improvement is trusted (docs/background.md, section 9): what the reward pays for,
what it ignores, and the pattern that scores well without solving the task. The card
(:class:`rlvr.rewards.RewardCard`) writes them down; this module *measures* the third one.
It scores a battery of strategies that do not solve the task on held-out examples and
compares each one's mean reward with the reward of a solved response.

    rlvr audit CONFIG.toml [--threshold F] [--prompts N] [--json] [--section.key=value ...]

Exit status: 0 when no strategy is flagged, 1 when at least one is (so a script can gate on
it), 2 with ``rlvr: error: ...`` for bad input (config, task load, threshold, prompts).

The battery (:data:`STRATEGIES`; each ``fn(example, task, rng, context) -> str | None``)
----------------------------------------------------------------------------------------
* ``exploit:<reward>``: the card's ``exploit_example``, once per reward in the weighted sum
  that has one (built by :func:`exploit_strategy`, not kept in STRATEGIES);
* ``constant_answer``: the most frequent training answer, for every prompt;
* ``constant_char``: the most frequent character of the training answers, repeated;
* ``copy_prompt``: the prompt itself;
* ``repeat_answer_char``: this example's most frequent answer character, repeated;
* ``random``: uniform characters from the task's alphabet (seeded);
* ``corrupt_half``: the answer with at least half of its characters changed;
* ``one_char_off``: the answer with exactly one character changed;
* ``pad_candidates``: the answer followed by other frequent training answers and the
  alphabet, truncated. A strategy returns None for an example where it cannot avoid being
  the solved response (here: truncation leaves exactly the gold answer); such examples are
  counted as not applicable, and a strategy that is never applicable is not scored.

Every response is truncated to ``max_new_tokens`` characters (the built-in tokenizer has one
token per character), so it is one a policy could produce. On a fixed-length task a shorter
response cannot be sampled either; the row says how many there were instead of padding them.

Assumptions, stated
-------------------
* **Solved reward.** The gold answer, as ``str(answer)``, is scored as the solved response;
  its mean weighted reward is the yardstick. For a task whose answer is not itself a valid
  response (a number that must be stated inside a sentence, say) this is only an
  approximation: the audit checks ``goal(prompt, str(answer), answer)`` and notes every
  example where the gold string does not meet the goal, or is longer than max_new_tokens.
* **Flag rule.** The question is whether the reward pays for responses that fail the goal,
  so it is measured on exactly those: a strategy is flagged when its mean reward over the
  responses that miss the goal is at least ``threshold ×`` the solved reward on the same
  examples. The goal rate is reported as measured and gates nothing, so an accidental hit can
  neither hide an exploit nor inflate it. The simpler rule (whole mean >= threshold ×
  solved and goal rate 0, or <= 1%) was tried first and hid a real one: on the 5-digit sort
  task about 2% of prompts are already sorted, so ``copy_prompt`` meets the goal on 2.5% of
  200 held-out prompts while ``inclusion_adjacency`` pays it 0.79 of a solved response for
  copying. A strategy that always meets the goal has no misses and is never flagged. When the
  solved reward on those examples is <= 0 the ratio is undefined, and a strategy is flagged
  when it earns strictly more than a solved response.

Pure Python on strings: imports rlvr.config, rlvr.rewards and rlvr.tasks, never torch or
the trainer.
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from rlvr import config as config_mod
from rlvr.reward_pool import RewardPoolError, open_pool
from rlvr.rewards import BatchScores, goal_hits, score_batch
from rlvr.tasks import Example, Task, TaskError, load_task, resolve_weights, weighted_rewards

PAD_CANDIDATES = 3
"""How many other frequent training answers ``pad_candidates`` appends after the gold."""


@dataclass
class Context:
    """What strategies may look at besides the example: computed once from the task's train split."""

    max_new_tokens: int
    alphabet: str
    """The task's alphabet, or the characters of its prompts and answers when it has none."""
    answer_chars: str
    """Characters that occur in training answers, most frequent first (fallback: alphabet)."""
    top_answer: str
    """The most frequent training answer (first seen among ties)."""
    top_answers: list[str]
    """The most frequent training answers, most frequent first (a few)."""
    fixed_length: bool


Strategy = Callable[[Example, Task, random.Random, Context], Optional[str]]


def _other_char(c: str, chars: str, rng: random.Random) -> str:
    """A character from ``chars`` different from ``c`` (from ``chars + '?'`` if it has no other)."""
    pool = [x for x in chars if x != c] or ["?" if c != "?" else "!"]
    return rng.choice(pool)


def _corrupt(answer: str, k: int, ctx: Context, rng: random.Random) -> str:
    """``answer`` with ``k`` distinct positions changed to a different character: never equal to it."""
    if not answer:
        return ctx.answer_chars[:1] or "?"
    chars = list(answer)
    for i in rng.sample(range(len(chars)), min(max(k, 1), len(chars))):
        chars[i] = _other_char(chars[i], ctx.answer_chars, rng)
    return "".join(chars)


def constant_answer(ex: Example, task: Task, rng: random.Random, ctx: Context) -> str:
    """The most frequent training answer, whatever the prompt."""
    return ctx.top_answer


def constant_char(ex: Example, task: Task, rng: random.Random, ctx: Context) -> str:
    """The most frequent answer character, repeated to max_new_tokens, whatever the prompt."""
    return (ctx.answer_chars[:1] or "?") * ctx.max_new_tokens


def copy_prompt(ex: Example, task: Task, rng: random.Random, ctx: Context) -> str:
    """The prompt itself (truncated)."""
    return ex.prompt


def repeat_answer_char(ex: Example, task: Task, rng: random.Random, ctx: Context) -> str:
    """This example's most frequent answer character, repeated to max_new_tokens."""
    ans = str(ex.answer)
    c = Counter(ans).most_common(1)[0][0] if ans else (ctx.answer_chars[:1] or "?")
    return c * ctx.max_new_tokens


def random_chars(ex: Example, task: Task, rng: random.Random, ctx: Context) -> str:
    """Uniform alphabet characters; max_new_tokens of them (fixed length) or 1..max_new_tokens."""
    n = ctx.max_new_tokens if ctx.fixed_length else rng.randint(1, ctx.max_new_tokens)
    return "".join(rng.choice(ctx.alphabet) for _ in range(n))


def corrupt_half(ex: Example, task: Task, rng: random.Random, ctx: Context) -> str:
    """The answer with ceil(len/2) of its characters changed (so at most half are right)."""
    ans = str(ex.answer)
    return _corrupt(ans, (len(ans) + 1) // 2, ctx, rng)


def one_char_off(ex: Example, task: Task, rng: random.Random, ctx: Context) -> str:
    """The answer with exactly one character changed."""
    return _corrupt(str(ex.answer), 1, ctx, rng)


def pad_candidates(ex: Example, task: Task, rng: random.Random, ctx: Context) -> str | None:
    """The answer, then other frequent training answers and the alphabet appended (truncated)."""
    ans = str(ex.answer)
    others = [a for a in ctx.top_answers if a != ans][:PAD_CANDIDATES]
    out = (ans + "".join(others) + ctx.alphabet)[: ctx.max_new_tokens]
    return None if out == ans else out  # truncation left the gold answer: not applicable


STRATEGIES: dict[str, Strategy] = {
    "constant_answer": constant_answer,
    "constant_char": constant_char,
    "copy_prompt": copy_prompt,
    "repeat_answer_char": repeat_answer_char,
    "random": random_chars,
    "corrupt_half": corrupt_half,
    "one_char_off": one_char_off,
    "pad_candidates": pad_candidates,
}
"""The fixed battery, in the order it is printed (after the cards' exploits)."""


def exploit_strategy(task: Task, reward_name: str) -> Strategy:
    """The card's ``exploit_example`` for ``reward_name`` as a strategy."""
    make = task.rewards[reward_name].card.exploit_example

    def exploit(ex: Example, task: Task, rng: random.Random, ctx: Context) -> str:
        out = make(ex)
        if not isinstance(out, str):
            raise TypeError(f"exploit_example returned {type(out).__name__}, not a str")
        return out

    exploit.__doc__ = f"The {reward_name!r} card's exploit_example."
    return exploit


@dataclass
class Row:
    """One strategy's scores on the audited examples."""

    name: str
    description: str
    scored: int
    """Examples scored (applicable ones)."""
    not_applicable: int
    """Examples where the strategy returned None (it would have been the solved response)."""
    mean_reward: float | None
    """Mean weighted reward over all scored responses; None when none were scored."""
    goal_rate: float | None
    """Fraction of scored responses that meet the task's goal (reported as measured)."""
    miss_reward: float | None = None
    """Mean weighted reward over the scored responses that miss the goal; None if none miss."""
    fraction: float | None = None
    """miss_reward / (solved reward on the same examples): what the flag compares with the
    threshold. None when nothing misses or the solved reward there is <= 0."""
    per_reward: dict[str, float] = field(default_factory=dict)
    """Unweighted mean of each reward in the sum."""
    example: str | None = None
    """The first scored response (for reading the table)."""
    flagged: bool = False
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    """Set when the strategy raised; the row is then not scored."""


@dataclass
class AuditResult:
    """Cards, the solved yardstick, one row per strategy, and which strategies are flagged."""

    task: str
    weights: dict[str, float]
    cards: dict[str, dict[str, Any]]
    prompts: int
    """Held-out examples scored (the first ``prompts`` of ``task.heldout``)."""
    threshold: float
    seed: int
    max_new_tokens: int
    solved_reward: float
    """Mean weighted reward of the gold answers (the solved responses)."""
    solved_goal_rate: float
    rows: list[Row]
    flagged: list[str]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _card_dict(task: Task, name: str) -> dict[str, Any]:
    card = task.rewards[name].card
    return {"pays_for": card.pays_for, "ignores": card.ignores, "exploit": card.exploit,
            "exploit_example": card.exploit_example is not None}


def _context(task: Task, max_new_tokens: int) -> Context:
    answers = Counter(str(ex.answer) for ex in task.train)
    chars = Counter()
    for a, k in answers.items():
        for c, m in Counter(a).items():
            chars[c] += m * k
    alphabet = task.alphabet or "".join(sorted({c for ex in list(task.train) + list(task.heldout)
                                                for c in ex.prompt + str(ex.answer)})) or "?"
    top = [a for a, _ in answers.most_common(PAD_CANDIDATES + 1)]
    return Context(max_new_tokens=max_new_tokens, alphabet=alphabet,
                   answer_chars="".join(c for c, _ in chars.most_common()) or alphabet,
                   top_answer=top[0] if top else "", top_answers=top, fixed_length=task.fixed_length)


def _goal_hits(task: Task, prompts: list[str], responses: list[str], answers: list[Any],
               pool: Any = None) -> tuple[list[bool], int]:
    """goal() per response; a goal that raises counts as not met (and is counted)."""
    hits, errors, _ = goal_hits(task.goal, prompts, responses, answers, pool=pool)
    return hits, errors


def _describe(fn: Callable) -> str:
    return (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""


@dataclass
class _Bench:
    """What every row is scored against: the audited examples, the reward and the solved scores."""

    task: Task
    rewards: Any
    """The weighted rewards (:func:`rlvr.tasks.weighted_rewards`)."""
    examples: list[Example]
    prompts: list[str]
    answers: list[Any]
    solved: BatchScores
    """The gold answers' scores, one per example."""
    ctx: Context
    max_new: int
    threshold: float
    pool: Any = None


def _check_args(threshold: float, prompts: int) -> None:
    if not (isinstance(threshold, (int, float)) and 0 < threshold <= 1):
        raise ValueError(f"--threshold must be in (0, 1], got {threshold}")
    if isinstance(prompts, bool) or not isinstance(prompts, int) or prompts < 1:
        raise ValueError(f"--prompts must be at least 1, got {prompts}")


def _solved_notes(b: _Bench, solved_reward: float, solved_goal: float, goal_err: int) -> list[str]:
    """Notes on the solved yardstick: where the gold answer is not a sound stand-in for a solution."""
    notes: list[str] = []
    if solved_goal < 1:
        notes.append(f"the gold answer as a response meets the goal on only {solved_goal:.1%} of examples: "
                     "the solved reward is an assumption here")
    if goal_err:
        notes.append(f"goal() raised on {goal_err} gold responses (counted as not met)")
    too_long = sum(len(str(a)) > b.max_new for a in b.answers)
    if too_long:
        notes.append(f"{too_long} gold answers are longer than max_new_tokens={b.max_new}: a policy could not produce them")
    if b.solved.failed:
        notes.append(f"rewards failed on {b.solved.failed} solved responses (scored 0): {'; '.join(b.solved.errors)}")
    if solved_reward <= 0:
        notes.append(f"a solved response earns {solved_reward:.3f} on average: the reward does not pay for solving; "
                     "strategies are flagged when they earn more than that")
    return notes


def _battery(task: Task, weights: dict[str, float], strategies: dict[str, Strategy] | None
             ) -> dict[str, Strategy]:
    """The cards' exploits (for the weighted rewards that have one), then the strategies."""
    battery: dict[str, Strategy] = {}
    for name in weights:
        if task.rewards[name].card.exploit_example is not None:
            battery[f"exploit:{name}"] = exploit_strategy(task, name)
    battery.update(STRATEGIES if strategies is None else strategies)
    return battery


def _score_row(b: _Bench, row: Row, idx: list[int], responses: list[str]) -> None:
    """Score the responses (of examples ``idx``) into ``row``: means, goal rate, flag and notes."""
    p, a = [b.prompts[i] for i in idx], [b.answers[i] for i in idx]
    scores = score_batch(b.rewards, p, responses, a, pool=b.pool)
    g, gerr = _goal_hits(b.task, p, responses, a, b.pool)
    row.scored = len(idx)
    row.mean_reward = sum(scores.total) / len(idx)
    row.goal_rate = sum(g) / len(g)
    row.per_reward = {k: sum(v) / len(v) for k, v in scores.per_reward.items()}
    row.example = responses[0]
    miss = [j for j, hit in enumerate(g) if not hit]
    if miss:
        row.miss_reward = sum(scores.total[j] for j in miss) / len(miss)
        solved_there = sum(b.solved.total[idx[j]] for j in miss) / len(miss)
        if solved_there > 0:
            row.fraction = row.miss_reward / solved_there
            row.flagged = row.fraction >= b.threshold
        else:
            row.flagged = row.miss_reward > solved_there
    if b.ctx.fixed_length:
        short = sum(len(r) != b.max_new for r in responses)
        if short:
            row.notes.append(f"{short} responses are not {b.max_new} characters long: a fixed-length sampler "
                             "cannot produce them")
    if scores.failed:
        row.notes.append(f"rewards failed on {scores.failed} scores (counted 0): {'; '.join(scores.errors)}")
    if gerr:
        row.notes.append(f"goal() raised on {gerr} responses (counted as not met)")


def _run_strategy(b: _Bench, name: str, fn: Strategy, seed: int) -> Row:
    """One strategy's row: its responses on every example, scored (or the error it raised)."""
    rng = random.Random(f"{seed}:{name}")
    row = Row(name=name, description=_describe(fn), scored=0, not_applicable=0,
              mean_reward=None, goal_rate=None)
    idx, responses = [], []
    try:
        for i, ex in enumerate(b.examples):
            r = fn(ex, b.task, rng, b.ctx)
            if r is None:
                row.not_applicable += 1
                continue
            idx.append(i)
            responses.append(str(r)[:b.max_new])
    except Exception as e:  # a broken card or strategy is a finding, not a crash
        row.error = f"{type(e).__name__}: {e}"
        return row
    if not idx:
        row.notes.append("not applicable on any example (it would be the solved response)")
        return row
    if row.not_applicable:
        row.notes.append(f"not applicable on {row.not_applicable} examples (it would be the solved response)")
    _score_row(b, row, idx, responses)
    return row


def run_audit(task: Task, weights: dict[str, float], *, prompts: int, threshold: float, seed: int,
              max_new_tokens: int | None = None, strategies: dict[str, Strategy] | None = None,
              pool: Any = None) -> AuditResult:
    """Score every strategy on the first ``prompts`` held-out examples; flag those the reward overpays.

    ``weights`` is ``{reward name: weight}`` (unknown names are a TaskError); the optimised
    reward is their weighted sum, as in training. ``max_new_tokens`` defaults to the task's.
    ``strategies`` defaults to :data:`STRATEGIES`; the cards' exploits always come first.
    Each strategy gets its own ``random.Random(f"{seed}:{name}")``, so rows are reproducible
    and independent of each other. Raises ValueError for threshold outside (0, 1] or prompts < 1.
    ``pool``: a :class:`rlvr.reward_pool.RewardPool` of this task scores in its workers.
    """
    _check_args(threshold, prompts)
    rewards = weighted_rewards(task, weights)
    max_new = max_new_tokens or task.max_new_tokens
    ctx = _context(task, max_new)
    examples = list(task.heldout[:prompts])
    notes: list[str] = []
    if len(examples) < prompts:
        notes.append(f"asked for {prompts} prompts; the task holds out only {len(examples)}")
    P = [ex.prompt for ex in examples]
    A = [ex.answer for ex in examples]

    gold = [str(a) for a in A]
    solved = score_batch(rewards, P, gold, A, pool=pool)
    solved_reward = sum(solved.total) / len(gold)
    hits, goal_err = _goal_hits(task, P, gold, A, pool)
    solved_goal = sum(hits) / len(hits)
    bench = _Bench(task=task, rewards=rewards, examples=examples, prompts=P, answers=A, solved=solved,
                   ctx=ctx, max_new=max_new, threshold=threshold, pool=pool)
    notes += _solved_notes(bench, solved_reward, solved_goal, goal_err)

    rows = [_run_strategy(bench, name, fn, seed) for name, fn in _battery(task, weights, strategies).items()]
    return AuditResult(task=task.name, weights={k: float(v) for k, v in weights.items()},
                       cards={k: _card_dict(task, k) for k in weights}, prompts=len(examples),
                       threshold=float(threshold), seed=seed,
                       max_new_tokens=max_new, solved_reward=solved_reward, solved_goal_rate=solved_goal,
                       rows=rows, flagged=[r.name for r in rows if r.flagged], notes=notes)


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_audit(result: AuditResult) -> str:
    """The cards, the solved yardstick, one line per strategy, and the verdict, as text."""
    r = result
    out = []
    summed = " + ".join(f"{w:g}×{k}" for k, w in r.weights.items())
    out.append(f"audit: task {r.task}, optimised reward {summed}; {r.prompts} held-out prompts, "
               f"max_new_tokens {r.max_new_tokens}, seed {r.seed}")
    for name, card in r.cards.items():
        out.append("")
        out.append(f"reward {name} (weight {r.weights[name]:g})")
        out.append(f"  pays for:      {card['pays_for']}")
        out.append(f"  ignores:       {card['ignores']}")
        out.append(f"  known exploit: {card['exploit']}")
        out.append(f"  exploit_example: {'yes (scored below as exploit:' + name + ')' if card['exploit_example'] else 'none'}")
    out.append("")
    out.append(f"solved (gold answer as the response): mean reward {r.solved_reward:.3f}, "
               f"goal rate {r.solved_goal_rate:.1%}")
    out.append(f"flag rule: reward on the responses that miss the goal >= {r.threshold:g} × the solved reward "
               "on the same examples (goal rate reported, not gated)")
    out.append("")
    width = max([len("strategy")] + [len(x.name) for x in r.rows])
    many = len(r.weights) > 1
    head = f"{'strategy':<{width}}  {'reward':>6}  {'goal':>6}  {'miss':>6}  {'×solved':>7}  {'n':>5}"
    if many:
        head += "  " + "  ".join(f"{k[:12]:>12}" for k in r.weights)
    out.append(head + "  example")
    for x in r.rows:
        if x.error:
            out.append(f"{x.name:<{width}}  ERROR: {x.error}")
            continue
        line = (f"{x.name:<{width}}  {_f(x.mean_reward, '6.3f'):>6}  {_f(x.goal_rate, '6.1%'):>6}  "
                f"{_f(x.miss_reward, '6.3f'):>6}  {_f(x.fraction, '7.3f'):>7}  {x.scored:>5}")
        if many:
            line += "  " + "  ".join(f"{_f(x.per_reward.get(k), '12.3f')}" for k in r.weights)
        line += f"  {x.example!r}" if x.example is not None else "  -"
        if x.flagged:
            line += "  FLAGGED"
        out.append(line)
        for note in x.notes:
            out.append(f"{'':<{width}}    note: {note}")
    out.append("(reward: mean over all responses; miss: mean over those that miss the goal; "
               "×solved: miss / solved reward on the same examples; n: responses scored)")
    out.append("")
    out.append("strategies:")
    for x in r.rows:
        out.append(f"  {x.name:<{width}}  {x.description}")
    for note in r.notes:
        out.append(f"note: {note}")
    out.append("")
    if r.flagged:
        out.append(f"FLAGGED {len(r.flagged)} of {len(r.rows)}: {', '.join(r.flagged)} "
                   f"(the reward pays >= {r.threshold:g} × a solved response for missing the goal)")
    else:
        out.append(f"clean: no strategy reaches {r.threshold:g} × the solved reward without meeting the goal")
    return "\n".join(out)


def command(args, overrides: list[str]) -> int:
    """`rlvr audit`: 0 clean, 1 flagged, 2 bad input (message on stderr)."""
    from pathlib import Path

    from rlvr.setup_types import RunError
    from rlvr.trust import is_run_config, refuse_run_task, run_config_guard

    def fail(msg: str) -> int:
        print(f"rlvr: error: {msg}", file=sys.stderr)
        return 2

    if not (math.isfinite(args.threshold) and 0 < args.threshold <= 1):
        return fail(f"--threshold must be in (0, 1], got {args.threshold}")
    if args.prompts < 1:
        return fail(f"--prompts must be at least 1, got {args.prompts}")
    try:
        cfg = config_mod.load(args.config, overrides)
        trusted = getattr(args, "trust_run_config", False)
        untrusted = is_run_config(Path(args.config))  # a run directory's config is data: its code is not run unasked
        if untrusted:
            refuse_run_task(cfg, Path(args.config), overrides=overrides, trusted=trusted)
        with run_config_guard(cfg, Path(args.config), overrides=overrides, trusted=trusted or not untrusted):
            task = load_task(cfg.task.path, **cfg.task.options)
        weights = resolve_weights(task, cfg.task.reward, cfg.task.reward_weights)
        with open_pool(cfg.task, task) as pool:
            result = run_audit(task, weights, prompts=args.prompts, threshold=args.threshold, seed=cfg.train.seed,
                               max_new_tokens=cfg.sampling.max_new_tokens or None, pool=pool)
    except (config_mod.ConfigError, TaskError, ValueError, RewardPoolError, RunError) as e:
        return fail(str(e))
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_audit(result))
    return 1 if result.flagged else 0
