"""Tasks from a file of rows: JSONL (stdlib), or parquet / arrow / csv through ``datasets``.

::

    [task]
    path = "rlvr.tasks.dataset:jsonl_task"
    reward = "exact_match"
    options = { train = "data/train.jsonl", heldout = "data/test.jsonl",
                rewards = ["exact_match", "my_rewards.py:close_enough"] }

Each row is a JSON object (one per line; blank lines are skipped). ``prompt_column`` is the
prompt (a str), ``answer_column`` the answer; every other column goes to ``Example.meta``.

The reward-call convention (meta)
---------------------------------
The reward contract is ``fn(prompt, response, answer)``. A reward of a dataset task may
*also* take the row's other columns: if its signature has a parameter named ``meta`` (or
``**kwargs``), it is called as ``fn(prompt, response, answer, meta=row_meta)``; otherwise as
``fn(prompt, response, answer)``. The signature is inspected once, when the task is built.
``answer`` is always the column's value as read from the file (str, number, list...), or the
whole row without the prompt (a dict) when ``answer_column=None``.

How the meta reaches the reward without changing the trainer: ``Example.answer`` is an
:class:`Answer` (``value`` + ``meta``); every reward and the goal of the task are wrapped so
that they unwrap it. ``str(Answer)`` is ``str(value)``, which is what the trainer, the audit
and the rollout log use (the char tokenizer alphabet, the solved yardstick, the log line).

Rewards
-------
``rewards`` is one spec, a list of specs, or a dict ``{name: spec}``; a spec is a built-in
name (``exact_match``), ``package.module:NAME`` or ``path/to/file.py:NAME`` (imported with
``importlib``; nothing is ``exec``'d from a string). NAME may be a function or an
:class:`rlvr.rewards.Reward` (its card is kept). A function with a ``card`` attribute (a
RewardCard) keeps that card; any other gets a card saying it is an unaudited user function.
Each spec becomes one entry of ``task.rewards`` (named after NAME or the dict key); choose or
weight them with the config's ``task.reward`` / ``task.reward_weights``. A dict value may also
be a table ``{path = "...", weight = 0.5}``: then the task also gets a reward ``weighted``, the
weighted sum (it raises if any part raises, so the failure is counted, never a silent 0);
``task.reward_weights`` is the better way (statuses per part), ``weighted`` is for one-name
configs.

The goal (``goal=None``) is "the first reward returns >= 1.0"; give ``goal`` as a spec to
use another function (called like a reward; truthy means solved).

Errors (TaskError, before any compute): a line that is not UTF-8, not JSON or not an object (file:line),
a directory given as a data file,
a missing prompt / answer column (named, with the columns the row has), a non-str prompt,
an empty file, a reward path that does not import (with the import error), held-out prompts
that also occur in train.
"""

from __future__ import annotations

import codecs
import importlib
import inspect
import json
import os
import random
from pathlib import Path
from typing import Any, Callable

from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Example, Task, TaskError, check_import, import_file, is_file, limits
from rlvr.tasks.answers import Answer, accepts_meta, unwrap, wrap_meta  # re-exported

__all__ = ["Answer", "jsonl_task", "read_rows", "resolve_reward", "wrap_meta", "exact_match",
           "BUILTIN_REWARDS", "accepts_meta", "unwrap"]

DATASETS_FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
"""File suffixes read through ``datasets.load_dataset(<format>, data_files=...)``."""


# ---------------------------------------------------------------------------------------------
# built-in rewards


def exact_match(prompt: str, response: str, answer: Any) -> float:
    """1.0 when the stripped response equals ``str(answer)`` stripped, else 0.0."""
    return 1.0 if response.strip() == str(Answer(answer)).strip() else 0.0


EXACT_MATCH_CARD = RewardCard(
    pays_for="a response equal to the answer column (both stripped of surrounding whitespace)",
    ignores=(
        "equivalent forms (0.5 vs 1/2, different spacing or case inside the answer) and any "
        "reasoning before the answer: a correct answer with an explanation scores 0"
    ),
    exploit=(
        "none known: it is the goal itself on every string. Its failure is sparsity and "
        "false negatives on equivalent answers, which push the policy to the exact surface form"
    ),
    exploit_example=None,
)

BUILTIN_REWARDS: dict[str, Reward] = {"exact_match": Reward("exact_match", exact_match, EXACT_MATCH_CARD)}
"""Rewards a dataset task may name without a path."""


def _user_card(spec: str, fn: Callable) -> RewardCard:
    doc = " ".join((inspect.getdoc(fn) or "").split())
    return RewardCard(
        pays_for=f"whatever {spec} returns" + (f" ({doc[:200]})" if doc else ""),
        ignores="unknown: a user reward without a RewardCard (give the function a `card` attribute)",
        exploit="unknown: not audited; run `rlvr audit` on this task before trusting a rise in it",
        exploit_example=None,
    )


def _import_object(spec: str, what: str) -> Any:
    """The object at ``pkg.mod:NAME`` or ``file.py:NAME`` (NAME is required): a Reward value or a function
    defined in that module (never a builtin or an imported name), and only a module of the project's
    tasks inside an ``untrusted_config`` block (rlvr.tasks)."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise TaskError(f"{what} {spec!r}: expected 'package.module:NAME' or 'path/to/file.py:NAME'")
    if not name.isidentifier():
        raise TaskError(f"{what} {spec!r}: {name!r} is not a Python name")
    check_import(target, f"{what} {spec!r}")
    if is_file(target):
        module = import_file(target, f"{what} {spec!r}")
    else:
        try:
            module = importlib.import_module(target)
        except SystemExit as e:
            raise TaskError(f"{what} {spec!r}: importing module {target!r} raised SystemExit({e.code!r}) "
                            "(sys.exit was called)") from None
        except Exception as e:
            raise TaskError(f"{what} {spec!r}: module {target!r} failed to import: "
                            f"{type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        found = sorted(k for k, v in vars(module).items() if not k.startswith("_") and callable(v)
                       and getattr(v, "__module__", None) == module.__name__)
        raise TaskError(f"{what} {spec!r}: {target} has no {name!r}; callables there: "
                        f"{', '.join(found) or 'none'}")
    obj = getattr(module, name)
    if not isinstance(obj, Reward) and not (inspect.isfunction(obj) and obj.__module__ == module.__name__):
        raise TaskError(f"{what} {spec!r}: {name} is not a Reward or a function defined in {target} (a built-in, "
                        f"a class or an imported name is refused); name the module that defines it")
    return obj


def resolve_reward(spec: Any, name: str | None = None) -> Reward:
    """A :class:`Reward` (meta-aware, see the module doc) from a built-in name or a path."""
    if isinstance(spec, Reward):
        obj = spec
        spec_s = spec.name
    elif callable(spec):
        obj = spec
        spec_s = getattr(spec, "__name__", repr(spec))
    elif isinstance(spec, str) and spec in BUILTIN_REWARDS:
        obj = BUILTIN_REWARDS[spec]
        spec_s = spec
    elif isinstance(spec, str) and ":" in spec:
        obj = _import_object(spec, "reward")
        spec_s = spec
    else:
        raise TaskError(
            f"reward {spec!r}: not a built-in ({', '.join(BUILTIN_REWARDS)}) nor a "
            "'package.module:NAME' / 'path/to/file.py:NAME' path"
        )
    if isinstance(obj, Reward):
        fn, card, default = obj.fn, obj.card, obj.name
    elif callable(obj):
        card = getattr(obj, "card", None)
        if not isinstance(card, RewardCard):
            card = _user_card(spec_s, obj)
        fn, default = obj, getattr(obj, "__name__", "reward")
    else:
        raise TaskError(f"reward {spec_s!r} is a {type(obj).__name__}, not a function or a Reward")
    return Reward(name or default, wrap_meta(fn), card)


def _weighted(parts: list[tuple[Reward, float]]) -> Reward:
    def weighted(prompt: str, response: str, answer: Any) -> float:
        total = 0.0
        for r, w in parts:
            v = r.fn(prompt, response, answer)  # a failure raises: counted as `error`
            if v is None:
                raise ValueError(f"part {r.name!r} returned None")
            total += w * float(v)
        return total

    desc = " + ".join(f"{w:g}*{r.name}" for r, w in parts)
    card = RewardCard(
        pays_for=f"the weighted sum {desc}: " + "; ".join(f"{r.name}: {r.card.pays_for}" for r, _ in parts),
        ignores="what every part ignores: " + "; ".join(f"{r.name}: {r.card.ignores}" for r, _ in parts),
        exploit="any part's exploit, scaled by its weight: " + "; ".join(f"{r.name}: {r.card.exploit}" for r, _ in parts),
        exploit_example=next((r.card.exploit_example for r, _ in parts if r.card.exploit_example), None),
    )
    return Reward("weighted", weighted, card)


def build_rewards(rewards: Any) -> dict[str, Reward]:
    """``task.rewards`` from one spec, a list of specs or a dict ``{name: spec or {path, weight}}``."""
    if isinstance(rewards, (str, Reward)) or callable(rewards):
        rewards = [rewards]
    out: dict[str, Reward] = {}
    weights: list[tuple[Reward, float]] = []
    if isinstance(rewards, dict):
        items = list(rewards.items())
    elif isinstance(rewards, (list, tuple)):
        items = [(None, s) for s in rewards]
    else:
        raise TaskError(f"rewards must be a spec, a list of specs or a dict, got {rewards!r:.80}")
    if not items:
        raise TaskError("rewards is empty: give at least one (e.g. 'exact_match')")
    for key, spec in items:
        weight = None
        if isinstance(spec, dict):
            unknown = set(spec) - {"path", "weight"}
            if "path" not in spec or unknown:
                raise TaskError(f"rewards[{key!r}] = {spec!r}: a table needs 'path' (and optional 'weight') only")
            weight, spec = spec.get("weight"), spec["path"]
            if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))):
                raise TaskError(f"rewards[{key!r}].weight must be a number, got {weight!r}")
        elif isinstance(spec, (int, float)) and not isinstance(spec, bool):
            raise TaskError(
                f"rewards[{key!r}] = {spec!r}: give {{path = ..., weight = {spec}}} (a path is required), "
                "or set weights with the config's task.reward_weights"
            )
        r = resolve_reward(spec, key)
        if r.name in out:
            raise TaskError(f"two rewards are named {r.name!r}; use a dict {{name: path}} to rename one")
        out[r.name] = r
        if weight is not None:
            weights.append((r, float(weight)))
    if weights:
        if "weighted" in out:
            raise TaskError("a reward is named 'weighted', which the weighted sum uses; rename it")
        out["weighted"] = _weighted(weights)
    return out


# ---------------------------------------------------------------------------------------------
# reading rows


def read_rows(path: str | os.PathLike) -> list[tuple[str, dict]]:
    """[(where, row)] of a JSONL file (where = 'file:line'; UTF-8, a leading byte-order mark dropped) or a
    parquet/arrow/csv file."""
    p = Path(path)
    if p.is_dir():
        raise TaskError(f"data file {str(p)!r} is a directory, not a file")
    if not p.is_file():
        raise TaskError(f"data file {str(p)!r} does not exist")
    try:
        limits.check_file("data file", p)                  # before reading a file larger than the machine
    except ValueError as e:
        raise TaskError(str(e)) from None
    fmt = DATASETS_FORMATS.get(p.suffix.lower())
    rows: list[tuple[str, dict]] = []
    if fmt is not None:
        try:
            import datasets  # lazy: heavy
        except ImportError as e:
            raise TaskError(f"{p}: reading {p.suffix} files needs the `datasets` package ({e})") from e
        try:
            ds = datasets.load_dataset(fmt, data_files=str(p), split="train")
        except Exception as e:
            raise TaskError(f"{p}: datasets could not read it as {fmt}: {type(e).__name__}: {e}") from e
        for i, row in enumerate(ds):
            rows.append((f"{p}:row {i + 1}", dict(row)))
    else:
        with open(p, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if lineno == 1:  # a UTF-8 byte-order mark, as spreadsheet and Windows exports write
                    raw = raw.removeprefix(codecs.BOM_UTF8)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise TaskError(f"{p}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                    "save the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TaskError(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno}): "
                                    f"{line.strip()[:80]!r}") from None
                if not isinstance(row, dict):
                    raise TaskError(f"{p}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
                rows.append((f"{p}:{lineno}", row))
    if not rows:
        raise TaskError(f"{p}: empty file (no rows)")
    return rows


def rows_to_examples(rows: list[tuple[str, dict]], prompt_column: str, answer_column: str | None) -> list[Example]:
    out = []
    for where, row in rows:
        cols = ", ".join(map(str, row)) or "none"
        if prompt_column not in row:
            raise TaskError(f"{where}: no prompt column {prompt_column!r}; the row has: {cols}")
        prompt = row[prompt_column]
        if not isinstance(prompt, str):
            raise TaskError(f"{where}: prompt column {prompt_column!r} is a {type(prompt).__name__}, not a str")
        meta = {k: v for k, v in row.items() if k != prompt_column and k != answer_column}
        if answer_column is None:
            value = dict(meta)
        else:
            if answer_column not in row:
                raise TaskError(f"{where}: no answer column {answer_column!r}; the row has: {cols}")
            value = row[answer_column]
        out.append(Example(prompt=prompt, answer=Answer(value, meta), meta=dict(meta, source=where)))
    return out


def split_heldout(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Train/held-out by prompt (rows sharing a prompt stay on one side), shuffled with ``seed``."""
    if not 0 < fraction < 1:
        raise TaskError(f"heldout_fraction must be in (0, 1), got {fraction!r}")
    prompts = list(dict.fromkeys(ex.prompt for ex in examples))
    if len(prompts) < 2:
        raise TaskError(f"cannot split {len(prompts)} distinct prompt(s) into train and held-out; give `heldout`")
    random.Random(seed).shuffle(prompts)
    k = min(len(prompts) - 1, max(1, round(fraction * len(prompts))))
    held = set(prompts[:k])
    return [ex for ex in examples if ex.prompt not in held], [ex for ex in examples if ex.prompt in held]


def jsonl_task(
    train: str,
    heldout: str | None = None,
    *,
    prompt_column: str = "prompt",
    answer_column: str | None = "answer",
    heldout_fraction: float = 0.1,
    seed: int = 0,
    rewards: Any = "exact_match",
    goal: Any = None,
    max_new_tokens: int = 64,
    name: str | None = None,
) -> Task:
    """A task from a JSONL (or parquet/arrow/csv) file of rows; see the module doc.

    ``heldout=None`` holds out ``heldout_fraction`` of the distinct prompts (shuffled with
    ``seed``). Tokenizer-agnostic: ``alphabet=None`` and ``fixed_length=False``.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise TaskError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    reward_map = build_rewards(rewards)  # resolve paths first: a bad path fails before reading data
    train_ex = rows_to_examples(read_rows(train), prompt_column, answer_column)
    if heldout is None:
        train_ex, held_ex = split_heldout(train_ex, heldout_fraction, seed)
    else:
        held_ex = rows_to_examples(read_rows(heldout), prompt_column, answer_column)
        overlap = {ex.prompt for ex in train_ex} & {ex.prompt for ex in held_ex}
        if overlap:
            sample = sorted(overlap)[:3]
            raise TaskError(f"heldout {heldout!r} overlaps train {train!r}: {len(overlap)} prompt(s) in both, "
                            f"e.g. {sample}; remove them from one file")

    if goal is None:
        first = next(iter(reward_map.values()))

        def goal_fn(prompt: str, response: str, answer: Any) -> bool:
            try:
                v = first.fn(prompt, response, answer)
                return v is not None and float(v) >= 1.0
            except Exception:
                return False

        goal_fn.__doc__ = f"Solved when reward {first.name!r} returns >= 1.0."
    else:
        g = resolve_reward(goal, "goal").fn

        def goal_fn(prompt: str, response: str, answer: Any) -> bool:
            try:
                return bool(g(prompt, response, answer))
            except Exception:
                return False

    return Task(
        name=name or Path(train).stem,
        train=train_ex,
        heldout=held_ex,
        rewards=reward_map,
        goal=goal_fn,
        max_new_tokens=max_new_tokens,
        alphabet=None,
        fixed_length=False,
    )


TASK = jsonl_task
