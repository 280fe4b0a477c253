"""reasoning-gym tasks by name, scored by the dataset's own ``score_answer``.

::

    [task]
    path = "rlvr.tasks.rgym:rgym_task"
    reward = "score"
    options = { name = "leg_counting", size = 2000, heldout = 200 }

``reasoning_gym.create_dataset(name, size=size + heldout, seed=seed, **config)`` draws the
entries (``question``, ``answer``, ``metadata``); the first ``heldout`` distinct questions are
held out and train is the rest minus any question equal to a held-out one. The prompt is the
question followed by ``INSTRUCTION`` (ask for ``<answer>...</answer>``).

Extracting the answer (``extract``)
-----------------------------------
* ``"auto"`` (default): the content of the last ``<answer>...</answer>`` (stripped, as
  ``reasoning_gym.utils.extract_answer``); with no tags, the last non-empty line, stripped;
  an empty response gives None.
* ``"tags"``: the tag content only; None when the tags are missing (the scorer gives 0).
* ``"raw"``: the whole response, stripped.

Rewards
-------
* ``score``: ``dataset.score_answer(extracted, entry)``, the raw value (many scorers give
  partial credit). A scorer that raises is *not* caught here: the exception reaches
  :func:`rlvr.rewards.score`, which counts it as status ``error`` (never a silent 0); a None
  it returns is counted as ``none``.
* ``solved``: 1.0 when ``score`` is exactly 1.0, else 0.0 (exceptions propagate the same way).

The goal is ``score == 1.0``; it inherits the scorer's leniency (see the card).

What the scorers reward (measured on reasoning-gym 0.1.25)
---------------------------------------------------------
The default ``ProceduralDataset.score_answer`` (leg_counting, basic_arithmetic, gcd, lcm,
base_conversion... about 35 datasets) gives ``len(gold) / len(answer)`` to any answer that
*contains* the gold string: a wrong ``5000`` for gold ``500`` scores 0.75, ``x 500 x`` 0.43.
``game_of_life_halting`` gives 1.0 to any non-empty string (it compares ``bool(answer)``, and
``bool("False")`` is True). gsm_symbolic (first number in the text), knights_knaves,
kakurasu, quantum_lock, sokoban and survo give 1.0 to the gold padded with junk; several
(countdown, puzzle24, power_function, color_cube_rotation...) pay 0.01 for any string.
prime_factorization raises ValueError on a non-numeric answer. The task measures a few such
patterns on its own training entries when it is built and writes the numbers on the card.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Example, Task, TaskError, limits
from rlvr.tasks.answers import Answer, unwrap

__all__ = ["rgym_task", "extract_answer", "dataset_names", "INSTRUCTION"]

INSTRUCTION = "\n\nGive only your final answer inside <answer></answer>."
"""Appended to every question."""
_TAG_RE = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
EXTRACT_MODES = ("auto", "tags", "raw")


def extract_answer(response: str, mode: str = "auto") -> str | None:
    """The final answer of a response (see the module doc), or None when there is none."""
    if mode == "raw":
        return response.strip()
    found = _TAG_RE.findall(response)
    if found:
        return found[-1].strip()
    if mode == "tags":
        return None
    lines = [ln for ln in response.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else None


def dataset_names() -> list[str]:
    """Every dataset name reasoning-gym registers (``reasoning_gym.factory.DATASETS``)."""
    from reasoning_gym.factory import DATASETS  # lazy: heavy

    return sorted(DATASETS)


def _probe(ds, entries: list[dict], extract: str) -> list[tuple]:
    """Mean score of a few non-solutions on ``entries``: [(pattern, mean, example response)]."""
    patterns = {
        "the gold answer padded: 'x GOLD x'": lambda g: f"<answer>x {g} x</answer>",
        "the gold answer with a digit appended: 'GOLD0'": lambda g: f"<answer>{g}0</answer>",
        "any short string: 'x'": lambda g: "<answer>x</answer>",
    }
    out = []
    for label, make in patterns.items():
        vals, failed = [], 0
        for e in entries:
            gold = e.get("answer")
            gold = "" if gold is None else str(gold)
            resp = make(gold)
            if extract_answer(resp, extract) == gold:
                continue
            try:
                vals.append(float(ds.score_answer(extract_answer(resp, extract), e)))
            except Exception:
                failed += 1
        if vals or failed:
            out.append((label, sum(vals) / len(vals) if vals else None, make, failed))
    return out


def _create_dataset(name: str, size: int, heldout: int, seed: int, extract: str,
                    max_new_tokens: int, config: dict | None):
    """Check the options and build the reasoning-gym dataset (TaskError on any bad input)."""
    if extract not in EXTRACT_MODES:
        raise TaskError(f"rgym: extract must be one of {EXTRACT_MODES}, got {extract!r}")
    for k, v in (("size", size), ("heldout", heldout), ("max_new_tokens", max_new_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TaskError(f"rgym: {k} must be a positive int, got {v!r}")
    try:
        import reasoning_gym
    except ImportError as e:
        raise TaskError(f"rgym: reasoning-gym is not installed ({e}); pip install reasoning-gym") from e
    names = dataset_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else "no close match"
        raise TaskError(f"rgym: unknown reasoning-gym dataset {name!r}; {hint} "
                        f"({len(names)} registered, see rlvr.tasks.rgym.dataset_names())")
    try:
        return reasoning_gym.create_dataset(name, size=size + heldout, seed=seed, **(config or {}))
    except Exception as e:
        raise TaskError(f"rgym: create_dataset({name!r}, size={size + heldout}, seed={seed}, "
                        f"**{config or {}}) failed: {type(e).__name__}: {e}") from e


def _split(entries: list[dict], name: str, heldout: int, instruction: str
           ) -> tuple[list[Example], list[Example]]:
    """(held out, train): the first ``heldout`` distinct questions, then the rest minus those."""

    def example(e: dict) -> Example:
        entry = {"question": e["question"], "answer": e["answer"], "metadata": e.get("metadata", {})}
        return Example(prompt=e["question"] + instruction, answer=Answer(e["answer"], entry),
                       meta=dict(entry["metadata"]))

    held: dict[str, Example] = {}
    rest = []
    for e in entries:
        p = e["question"] + instruction
        if len(held) < heldout and p not in held:
            held[p] = example(e)
        else:
            rest.append(e)
    train_ex = [example(e) for e in rest if e["question"] + instruction not in held]
    if not train_ex or not held:
        raise TaskError(f"rgym: {name} gave {len(held)} held-out and {len(train_ex)} training entries "
                        f"with distinct questions out of {len(entries)}; ask for a larger size")
    return list(held.values()), train_ex


def _scorers(ds, extract: str):
    """The ``score`` and ``solved`` rewards and the goal, all on ``ds.score_answer``."""

    def score(prompt: str, response: str, answer: Any) -> float:
        _, entry = unwrap(answer)
        return ds.score_answer(extract_answer(response, extract), entry)  # raises → status error

    def solved(prompt: str, response: str, answer: Any) -> float:
        v = score(prompt, response, answer)
        if v is None:
            raise ValueError("score_answer returned None")
        return 1.0 if float(v) == 1.0 else 0.0

    def goal(prompt: str, response: str, answer: Any) -> bool:
        try:
            return solved(prompt, response, answer) == 1.0
        except Exception:
            return False

    return score, solved, goal


def _cards(ds, name: str, extract: str, train_ex: list[Example], probe: int
           ) -> tuple[RewardCard, RewardCard]:
    """The ``score`` and ``solved`` cards, with the numbers measured on ``probe`` training entries."""
    from reasoning_gym.dataset import ProceduralDataset

    default_scorer = type(ds).score_answer is ProceduralDataset.score_answer
    measured = _probe(ds, [unwrap(ex.answer)[1] for ex in train_ex[:probe]], extract) if probe else []
    best = max((m for m in measured if m[1] is not None), key=lambda m: m[1], default=None)
    numbers = "; ".join(
        (f"{label} scores {mean:.2f} on average" + (f" ({failed} raised)" if failed else "")
         if mean is not None else f"{label}: the scorer raised on all {failed}")
        for label, mean, _, failed in measured
    )
    exploit = (
        (f"measured on {min(probe, len(train_ex))} training entries: {numbers}. " if measured else "")
        + ("This dataset uses reasoning-gym's default scorer: any answer containing the gold string "
           "scores len(gold)/len(answer), so a wrong answer with the gold inside (GOLD0) gets "
           "partial credit, and padding is paid in proportion. "
           if default_scorer else
           "This dataset has its own scorer; reasoning-gym scorers are lenient in places "
           "(game_of_life_halting pays 1.0 for any non-empty string; gsm_symbolic, knights_knaves, "
           "sokoban, survo pay 1.0 for the gold padded with junk; several pay 0.01 for any string). ")
        + "The goal (score == 1.0) shares the scorer, so a scorer that pays 1.0 for junk fools it too"
    )

    def exploit_example(ex: Example) -> str:
        gold = unwrap(ex.answer)[0]
        make = best[2] if best and best[1] > 0 else (lambda g: f"<answer>x {g} x</answer>")
        return make("" if gold is None else str(gold))

    card_score = RewardCard(
        pays_for=f"reasoning-gym's score_answer for {name!r} on the extracted answer "
                 f"(extract={extract!r}: last <answer> tags, else the last line), partial credit as the scorer gives it",
        ignores="the reasoning before the answer, and (for most scorers) anything the string match does not see",
        exploit=exploit,
        exploit_example=exploit_example if (best and best[1] > 0) else None,
    )
    card_solved = RewardCard(
        pays_for=f"score_answer == 1.0 for {name!r} (the goal, binarised)",
        ignores="partial credit: a nearly right answer scores 0 like a wrong one (sparse)",
        exploit=("only where the scorer pays a full 1.0 to a non-solution; "
                 + (f"measured: {numbers}" if measured else "not measured (probe=0)")),
        exploit_example=(exploit_example if (best and best[1] >= 1.0) else None),
    )
    return card_score, card_solved


def rgym_task(
    name: str = "leg_counting",
    size: int = 1000,
    heldout: int = 100,
    seed: int = 0,
    max_new_tokens: int = 256,
    extract: str = "auto",
    config: dict | None = None,
    instruction: str = INSTRUCTION,
    probe: int = 20,
) -> Task:
    """A reasoning-gym dataset as a task: ``size`` training and ``heldout`` held-out entries.

    ``config`` is passed to ``create_dataset`` (the dataset's own options, e.g.
    ``{min_animals = 2}``). ``probe`` training entries are scored with a few non-solutions to
    put measured numbers on the ``score`` card (0 skips it). Unknown ``name`` → TaskError with
    the close matches. Tokenizer-agnostic: ``alphabet=None``, ``fixed_length=False``.
    """
    limits.check_count("rgym_task", "size", size)
    limits.check_count("rgym_task", "heldout", heldout)
    ds = _create_dataset(name, size, heldout, seed, extract, max_new_tokens, config)
    held, train_ex = _split([ds[i] for i in range(len(ds))], name, heldout, instruction)
    score, solved, goal = _scorers(ds, extract)
    card_score, card_solved = _cards(ds, name, extract, train_ex, probe)
    return Task(
        name=f"rgym-{name}",
        train=train_ex,
        heldout=held,
        rewards={"score": Reward("score", score, card_score), "solved": Reward("solved", solved, card_solved)},
        goal=goal,
        max_new_tokens=max_new_tokens,
        alphabet=None,
        fixed_length=False,
    )


TASK = rgym_task
