"""Task families: prompts, answers, rewards and the goal check, one file each.

The task contract
=================

A task is a plain :class:`Task` value. Training reads ``train``; evaluation reads ``heldout``
and ``goal``; the run optimizes one of ``rewards`` (or a weighted sum of several, chosen by
the config's ``task.reward``).

``name``
    A short name used in logs and run directories.
``train``
    A sequence of :class:`Example` (``prompt``, ``answer``, ``meta``) the trainer samples
    prompts from.
``heldout``
    Examples that never appear in a training batch: no held-out prompt may equal a training
    prompt. Held-out accuracy on ``goal`` is the number a run is judged by.
``rewards``
    ``{name: Reward}``: the proxies a run may optimize. Each is a deterministic function
    ``fn(prompt, response, answer) -> float`` that returns a number for *any* string, and
    carries a :class:`~rlvr.rewards.RewardCard` saying what it pays for, what it ignores,
    and a pattern that scores well without solving the task.
``goal``
    ``goal(prompt, response, answer) -> bool``: the real target. Evaluation only; never a
    training signal, so a reward that drifts from it shows up as a gap between the two.
``max_new_tokens``
    The most tokens a response may have: bounds sampling and prices a run before it starts.
``alphabet``
    The characters the built-in character tokenizer knows, or None to derive them from the
    prompts and answers. When given, every prompt character must be in it.
``fixed_length``
    True: every response is exactly ``max_new_tokens`` tokens and no end token is sampled
    (the sort task). False (default): a response ends at an end-of-sequence token or at
    ``max_new_tokens``, whichever comes first.
``step_delimiter``
    How a process reward's steps are cut (a reward may return a list of floats, one score per
    step): "" (default) = one step per response character, which is one per token with the
    built-in character tokenizer; otherwise each step ends with this text.

Writing a task
--------------

Put a ``Task`` (or a function returning one) in a module or a file and point the run at it::

    # my_task.py
    from rlvr.rewards import Reward, RewardCard
    from rlvr.tasks import Example, Task

    def make(n_train=100):
        ...
        return Task(name="mine", train=..., heldout=..., rewards={"exact": Reward(...)},
                    goal=..., max_new_tokens=8)

    load_task("my_task.py:make", n_train=50)       # a file
    load_task("rlvr.tasks.sort:TASK", n=6)         # an importable module
    load_task("rlvr.tasks.sort")                   # NAME defaults to TASK

:func:`load_task` imports the module (files by path through ``importlib``; nothing is
``exec``'d from a string and nothing is unpickled), calls the object with the keyword
arguments if it is a function, and checks the contract with :func:`validate_task`. Every
error names the path and the field at fault.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from rlvr.rewards import Reward, RewardCard

__all__ = ["Example", "Task", "TaskError", "load_task", "validate_task", "import_file", "is_file"]

DEFAULT_NAME = "TASK"
"""The name :func:`load_task` looks up when the path has no ``:NAME``."""


@dataclass
class Example:
    """One prompt with the answer the rewards and the goal compare against: the unit of every task's
    train and held-out splits."""

    prompt: str
    answer: Any
    meta: dict = field(default_factory=dict)
    """Anything else a task wants to keep beside the example (difficulty, source id...)."""


@dataclass
class Task:
    """A training set, a disjoint held-out set, named rewards, and the real goal."""

    name: str
    train: Sequence[Example]
    """Examples the trainer samples prompts from."""
    heldout: Sequence[Example]
    """Evaluation examples; their prompts never occur in ``train``."""
    rewards: dict[str, Reward]
    """The proxies a run may optimize; config ``task.reward`` picks one or weights several."""
    goal: Callable[[str, str, Any], bool]
    """``goal(prompt, response, answer)``: the real target, for evaluation only."""
    max_new_tokens: int
    """Bound on response length in tokens, for sampling and for pricing a run."""
    alphabet: str | None = None
    """Characters of the built-in char tokenizer; None derives them from the data."""
    fixed_length: bool = False
    """True: responses are exactly ``max_new_tokens`` tokens, no end token is sampled."""
    step_delimiter: str = ""
    """For a process reward (one that returns a list of per-step scores): the text that ends a
    step, e.g. "\\n"; "" = one step per response character, i.e. per token with the character
    tokenizer (see rlvr.advantages.token_steps)."""
    tool: Callable[[str, str, Any], str | None] | None = None
    """``tool(prompt, response_so_far, answer)``: called when a response stops at one of the run's
    ``sampling.stop`` strings (with ``sampling.max_tool_calls`` > 0); returns the text to insert
    into the response before sampling goes on, or None to end the response there. It runs in
    the reward workers (or the trainer's process) on model output: parse, never ``eval``. See rlvr.tools."""
    demonstrate: Callable[[Example], str | list | None] | None = None
    """``demonstrate(example)``: a worked response for a training example, for ``rlvr sft`` (rlvr.sft):
    the response text, or the turns after the prompt as ``{"role", "content"}`` messages (assistant turns
    trained on, tool or user turns inserted between them), or None to skip that example."""
    environment: Callable[[], Any] | None = None
    """Makes one fresh environment per episode (rlvr.environments: ``reset(prompt, answer)``,
    ``step(action) -> (observation, reward, done)``), stepped at every action the policy finishes, in
    the reward workers; its rewards and goal then receive each response as an ``Episode`` (the text
    with its turns). A task has a ``tool`` or an environment, not both."""


class TaskError(ValueError):
    """A task path that does not load, or a task that breaks the contract."""


def _check_rewards(rewards: Any) -> None:
    """Raise TaskError naming the first reward that is not a named Reward with a complete card."""
    if not isinstance(rewards, dict) or not rewards:
        raise TaskError(
            f"rewards must be a non-empty dict of name -> Reward, got {rewards!r:.80}"
        )
    for key, r in rewards.items():
        if not isinstance(r, Reward):
            raise TaskError(f"rewards[{key!r}] is a {type(r).__name__}, not a rlvr.rewards.Reward")
        if r.name != key:
            raise TaskError(f"rewards[{key!r}] is named {r.name!r}; the key must be its name")
        if not callable(r.fn):
            raise TaskError(f"rewards[{key!r}].fn is not callable: {r.fn!r:.80}")
        if not isinstance(r.card, RewardCard):
            raise TaskError(
                f"rewards[{key!r}] has no RewardCard (card is {type(r.card).__name__}); "
                "name what it pays for, ignores, and how it is exploited"
            )
        for part in ("pays_for", "ignores", "exploit"):
            text = getattr(r.card, part)
            if not isinstance(text, str) or not text.strip():
                raise TaskError(f"rewards[{key!r}].card.{part} must be a non-empty str")
        ex_fn = r.card.exploit_example
        if ex_fn is not None and not callable(ex_fn):
            raise TaskError(f"rewards[{key!r}].card.exploit_example is not callable or None")


def validate_task(task: Any) -> None:
    """Raise TaskError naming the first field of ``task`` that breaks the contract.

    Checks: it is a Task; ``name`` a non-empty str; ``train`` and ``heldout`` non-empty
    sequences of Example with str prompts; no held-out prompt in ``train``; ``rewards`` a
    non-empty dict of Reward keyed by their names, each with a callable ``fn`` and a complete
    RewardCard; ``goal`` callable; ``max_new_tokens`` a positive int; ``alphabet`` None or a
    non-empty str holding every prompt character; ``fixed_length`` a bool; ``step_delimiter``
    a str.
    Cost: one pass over train and heldout.
    """
    if not isinstance(task, Task):
        raise TaskError(f"is a {type(task).__name__}, not a rlvr.tasks.Task")
    if not isinstance(task.name, str) or not task.name:
        raise TaskError(f"name must be a non-empty str, got {task.name!r}")
    prompts: dict[str, set[str]] = {}
    for split in ("train", "heldout"):
        examples = getattr(task, split)
        if isinstance(examples, (str, bytes)) or not isinstance(examples, Sequence):
            raise TaskError(
                f"{split} must be a sequence of Example (a list or tuple), "
                f"got {type(examples).__name__}"
            )
        if len(examples) == 0:
            raise TaskError(f"{split} is empty")
        for i, ex in enumerate(examples):
            if not isinstance(ex, Example):
                raise TaskError(f"{split}[{i}] is a {type(ex).__name__}, not an Example")
            if not isinstance(ex.prompt, str):
                raise TaskError(
                    f"{split}[{i}].prompt is a {type(ex.prompt).__name__}, not a str"
                )
        prompts[split] = {ex.prompt for ex in examples}
    overlap = prompts["train"] & prompts["heldout"]
    if overlap:
        sample = sorted(overlap)[:3]
        raise TaskError(
            f"heldout overlaps train: {len(overlap)} held-out prompt(s) also in train, "
            f"e.g. {sample}"
        )
    _check_rewards(task.rewards)
    if not callable(task.goal):
        raise TaskError(f"goal is not callable: {task.goal!r:.80}")
    m = task.max_new_tokens
    if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
        raise TaskError(f"max_new_tokens must be a positive int, got {m!r}")
    if task.alphabet is not None:
        if not isinstance(task.alphabet, str) or not task.alphabet:
            raise TaskError(f"alphabet must be None or a non-empty str, got {task.alphabet!r}")
        used = set("".join(prompts["train"])) | set("".join(prompts["heldout"]))
        missing = used - set(task.alphabet)
        if missing:
            raise TaskError(
                f"alphabet {task.alphabet!r} lacks prompt characters {''.join(sorted(missing))!r}"
            )
    if not isinstance(task.fixed_length, bool):
        raise TaskError(f"fixed_length must be a bool, got {task.fixed_length!r}")
    if not isinstance(task.step_delimiter, str):
        raise TaskError(f"step_delimiter must be a str, got {task.step_delimiter!r}")
    if task.tool is not None and not callable(task.tool):
        raise TaskError(f"tool must be None or callable, got {task.tool!r:.80}")
    if task.environment is not None and not callable(task.environment):
        raise TaskError(f"environment must be None or a class (callable) making one environment per episode, got "
                        f"{task.environment!r:.80}")
    if task.environment is not None and task.tool is not None:
        raise TaskError("a task has a tool or an environment, not both: the environment answers every action "
                        "(rlvr.environments)")
    if task.demonstrate is not None and not callable(task.demonstrate):
        raise TaskError(f"demonstrate must be None or callable, got {task.demonstrate!r:.80}")


def is_file(target: str) -> bool:
    """True when an import target names a file (``*.py`` or a path) rather than a module."""
    return target.endswith(".py") or "/" in target or os.sep in target


PROJECT_TASKS = "rlvr.tasks"
"""The package whose modules a run directory's config may name (see :func:`untrusted_config`)."""

_MODULE_NAME = re.compile(r"^\s*([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):([A-Za-z_]\w*)\s*$")
_PY_FILE = re.compile(r"\.(py|pyw|pyc|so|pyd)\s*(:[^:/\\]*)?$", re.IGNORECASE)


def in_project_tasks(target: str) -> bool:
    """True when the import target ``target`` is a module of the project's task package
    (``rlvr.tasks.NAME``, or deeper); never a file. The package itself (its loaders) is not one."""
    return isinstance(target, str) and not is_file(target) and target.startswith(PROJECT_TASKS + ".")


def names_code(value: str) -> str | None:
    """The import target a string names when it is code: a Python file (``x.py``, ``x.py:NAME``) or a
    ``package.module:NAME``; None for any other string (a file of data, a word)."""
    text = value.strip()
    if _PY_FILE.search(text):
        return text.rpartition(":")[0] if re.search(r"\.py\w?\s*:", text) else text
    m = _MODULE_NAME.match(text)
    return m.group(1) if m else None


def foreign_code(options: Any, key: str = "task.options") -> list[tuple[str, str]]:
    """``(key, string)`` for every string in ``options`` (nested tables and lists included) that names
    code outside the project's task modules (:func:`names_code`, :func:`in_project_tasks`)."""
    if isinstance(options, str):
        target = names_code(options)
        return [(key, options)] if target is not None and not in_project_tasks(target) else []
    if isinstance(options, dict):
        return [hit for k, v in options.items() for hit in foreign_code(v, f"{key}.{k}")]
    if isinstance(options, (list, tuple)):
        return [hit for i, v in enumerate(options) for hit in foreign_code(v, f"{key}[{i}]")]
    return []


_UNTRUSTED: contextvars.ContextVar[tuple[str, frozenset[str]] | None] = contextvars.ContextVar(
    "rlvr_untrusted_config", default=None)


@contextlib.contextmanager
def untrusted_config(source: str | None, allow: Sequence[str] = ()) -> Iterator[None]:
    """Within the block, every import by name (:func:`load_task`, a dataset task's reward, a mixture's
    component) must be a module of :data:`PROJECT_TASKS`, or one of the import targets in ``allow``
    (what the user named on the command line); anything else is a TaskError naming ``source`` (the
    config it came from). ``source=None``: no restriction (a config the user passed as their own)."""
    token = _UNTRUSTED.set(None if source is None else (source, frozenset(allow)))
    try:
        yield
    finally:
        _UNTRUSTED.reset(token)


def check_import(target: str, what: str) -> None:
    """TaskError when an :func:`untrusted_config` block is active and ``target`` is not allowed in it."""
    active = _UNTRUSTED.get()
    if active is None:
        return
    source, allow = active
    if in_project_tasks(target) or target in allow:
        return
    raise TaskError(f"{what}: {source} is data (a run directory's config), so it may name only the project's "
                    f"task modules ({PROJECT_TASKS}.*), not {target!r}; pass --trust-run-config to run its code")


def split_path(path: str) -> tuple[str, str]:
    """``(import target, NAME)`` of a task path; NAME defaults to :data:`DEFAULT_NAME`."""
    target, sep, name = path.rpartition(":")
    if not sep or not target or is_file(name):  # no ':NAME' (or a Windows drive colon)
        return path, DEFAULT_NAME
    return target, name


def defined_refusal(obj: Any, module: Any, name: str) -> str | None:
    """Why ``module.name`` (``obj``) is not a task: None for a Task value or a Python function defined in
    ``module`` itself; a builtin (``os:system``), a class or a name the module imported is refused, so
    that a path runs only the factory it names."""
    if isinstance(obj, Task):
        return None
    if inspect.isfunction(obj) and obj.__module__ == module.__name__:
        return None
    home = getattr(obj, "__module__", None)
    if not callable(obj):
        return f"{name} is a {type(obj).__name__}, not a Task or a function returning one"
    if inspect.isbuiltin(obj) or home in (None, "builtins"):
        kind = "a built-in"
    elif inspect.isclass(obj):
        kind = "a class"
    elif inspect.isfunction(obj):
        kind = f"imported from {home}"
    else:
        kind = f"a {type(obj).__name__}"
    return (f"{name} is {kind}, not a Task or a function defined in {module.__name__}; name the module that "
            f"defines the task function")


def project_task_refusal(path: str) -> str | None:
    """Why ``path`` is not one of the project's own task factories: None for ``rlvr.tasks.NAME:factory``
    where factory is a Task value or a function defined there and annotated ``-> Task``."""
    if not isinstance(path, str):
        return f"{path!r} is not a task path"
    target, name = split_path(path)
    if not in_project_tasks(target):
        return f"{path!r} is not one of the project's task modules ({PROJECT_TASKS}.NAME)"
    try:
        module = importlib.import_module(target)
    except Exception as e:
        return f"{path!r}: module {target!r} failed to import: {type(e).__name__}: {e}"
    if not name.isidentifier() or not hasattr(module, name):
        return f"{path!r}: {target} has no {name!r}"
    obj = getattr(module, name)
    why = defined_refusal(obj, module, name)
    if why is not None:
        return f"{path!r}: {why}"
    if not isinstance(obj, Task) and inspect.signature(obj).return_annotation not in (Task, "Task"):
        return f"{path!r}: {name} is not a task factory (a function annotated to return a Task)"
    return None


def names_a_file(path: str) -> bool:
    """True when the task path ``path`` names a Python file (``file.py:NAME``) rather than a module of
    an installed package (``package.module:NAME``): loading it runs that file's code."""
    if not isinstance(path, str):
        return False
    target, sep, name = path.rpartition(":")
    if not sep or not target or is_file(name):
        target = path
    return is_file(target)


def import_file(target: str, path: str):
    """The module in the file ``target``, imported through importlib (never exec'd from a string).

    TaskError, with ``path`` (what the caller was loading) in the message, when the file does
    not exist, is not a Python module, fails to import or calls sys.exit while importing.
    """
    file = os.path.abspath(target)
    if not os.path.isfile(file):
        raise TaskError(f"{path}: file does not exist: {file}")
    # A stable, unique module name per file, registered in sys.modules so that dataclasses
    # and other code that looks up its own module work as in a normal import.
    digest = hashlib.sha1(file.encode()).hexdigest()[:10]
    stem = os.path.splitext(os.path.basename(file))[0]
    mod_name = f"_rlvr_task_{''.join(c if c.isalnum() else '_' for c in stem)}_{digest}"
    spec = importlib.util.spec_from_file_location(mod_name, file)
    if spec is None or spec.loader is None:
        raise TaskError(f"{path}: cannot import {file} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        sys.modules.pop(mod_name, None)
        if isinstance(e, SystemExit):
            raise TaskError(_exited(path, f"importing {file}", e)) from None
        if not isinstance(e, Exception):
            raise
        raise TaskError(f"{path}: {file} failed to import: {type(e).__name__}: {e}") from e
    return module


def _exited(path: str, doing: str, e: SystemExit) -> str:
    """The message for a task that called sys.exit (or raised SystemExit) while loading."""
    return (f"{path}: {doing} raised SystemExit({e.code!r}) (sys.exit was called); a task module or factory "
            "must not exit: raise an exception with the reason instead")


def _import_module(target: str, path: str):
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name is not None and (target == e.name or target.startswith(e.name + ".")):
            raise TaskError(
                f"{path}: no module named {target!r} (give 'package.module:NAME' for an "
                "importable module or 'path/to/file.py:NAME' for a file)"
            ) from e
        raise TaskError(_import_failed(path, target, e)) from e
    except SystemExit as e:
        raise TaskError(_exited(path, f"importing module {target!r}", e)) from None
    except Exception as e:
        raise TaskError(_import_failed(path, target, e)) from e


def _import_failed(path: str, target: str, e: Exception) -> str:
    return f"{path}: module {target!r} failed to import: {type(e).__name__}: {e}"


def _candidates(module) -> list[str]:
    """Names in ``module`` that could be a task: Task values and functions defined there."""
    out = []
    for k, v in vars(module).items():
        if k.startswith("_"):
            continue
        if isinstance(v, Task) or (
            inspect.isfunction(v) and getattr(v, "__module__", None) == module.__name__
        ):
            out.append(k)
    return sorted(out)


def check_options(path: str, name: str, fn: Callable, options: dict) -> None:
    """Refuse options that the task function `fn` does not take, listing the ones it does.

    Read from ``inspect.signature``; a function with ``**kwargs`` (or one whose signature cannot
    be read) takes anything. This is the error a user meets after changing ``--task.path`` while
    the config file still sets options for the old task.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in options if k not in takes]
    if not unknown:
        return
    hints = [f"{k!r} -> {close[0]!r}" for k in unknown for close in [difflib.get_close_matches(k, takes, n=1)] if close]
    raise TaskError(
        f"{path}: task.options {', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not "
        f"taken by {name}(); it takes: {', '.join(takes) if takes else 'no options'}"
        + (f" (did you mean {', '.join(hints)}?)" if hints else "")
        + ". Options from the config file stay when --task.path changes: replace them with "
        "--task.options='{...}' or set one with --task.options.NAME=VALUE"
    )


def load_task(path: str, **kwargs: Any) -> Task:
    """Load the task at ``path`` and check it against the contract.

    ``path`` is ``package.module:NAME`` or ``path/to/file.py:NAME`` (NAME defaults to
    ``TASK``). NAME may be a Task, or a function defined in that module (never a builtin, a class
    or a name the module imported: see :func:`defined_refusal`) returning one, which is called with
    ``kwargs``. Inside an :func:`untrusted_config` block only the project's task modules load. Raises TaskError, with ``path`` in the message, when the file does not exist,
    the module does not import (the import error is shown), the module or the call raises
    SystemExit (``sys.exit``: never a silent exit of the caller), NAME is missing (the candidate
    names are listed), a keyword is not a parameter of NAME (the parameters are listed; see
    :func:`check_options`), the call fails, or the result breaks the contract
    (see :func:`validate_task`).
    """
    if not isinstance(path, str) or not path.strip():
        raise TaskError(f"task path must be 'package.module:NAME' or 'file.py:NAME', got {path!r}")
    target, name = split_path(path)
    if not name.isidentifier():
        raise TaskError(f"{path}: {name!r} is not a Python name")
    check_import(target, path)
    module = import_file(target, path) if is_file(target) else _import_module(target, path)
    if not hasattr(module, name):
        found = _candidates(module)
        listing = ", ".join(found) if found else "none (no Task values or functions)"
        raise TaskError(f"{path}: {target} has no {name!r}; tasks or functions there: {listing}")
    obj = getattr(module, name)
    why = defined_refusal(obj, module, name)
    if why is not None:
        raise TaskError(f"{path}: {why}")
    if isinstance(obj, Task):
        if kwargs:
            raise TaskError(
                f"{path}: {name} is a Task value, so it takes no arguments, "
                f"but got {sorted(kwargs)}; make {name} a function to parameterize it"
            )
        task = obj
    elif callable(obj):
        check_options(path, name, obj, kwargs)
        try:
            task = obj(**kwargs)
        except SystemExit as e:
            raise TaskError(_exited(path, f"calling {name}(**{kwargs!r})", e)) from None
        except Exception as e:
            raise TaskError(
                f"{path}: calling {name}(**{kwargs!r}) failed: {type(e).__name__}: {e}"
            ) from e
        if not isinstance(task, Task):
            raise TaskError(f"{path}: {name}(...) returned a {type(task).__name__}, not a Task")
    else:
        raise TaskError(
            f"{path}: {name} is a {type(obj).__name__}, not a Task or a function returning one"
        )
    try:
        validate_task(task)
    except TaskError as e:
        label = getattr(task, "name", name)
        raise TaskError(f"{path}: task {label!r} breaks the contract: {e}") from e
    return task


def weighted_rewards(task: Task, weights: dict[str, float]) -> dict[str, tuple[Reward, float]]:
    """{name: (reward, weight)} for `rlvr.rewards.score_batch`; unknown names are a TaskError."""
    missing = [n for n in weights if n not in task.rewards]
    if missing:
        raise TaskError(f"task {task.name!r} has no reward {missing[0]!r}; it has {', '.join(task.rewards)}")
    return {name: (task.rewards[name], float(w)) for name, w in weights.items()}


def resolve_weights(task: Task, reward: str, reward_weights: dict) -> dict[str, float]:
    """{reward name: weight} a run optimises: `reward_weights` when given, else {reward: 1}.

    The config keys `task.reward` / `task.reward_weights` are named in the error for a reward the
    task does not have."""
    weights = dict(reward_weights) or {reward: 1.0}
    for name in weights:
        if name not in task.rewards:
            key = "task.reward_weights" if reward_weights else "task.reward"
            raise TaskError(f"{key}: task {task.name!r} has no reward {name!r}; it has {', '.join(task.rewards)}")
    return {k: float(v) for k, v in weights.items()}
