"""The answer/meta convention: an answer that carries its row's other columns to the rewards.

The reward contract is ``fn(prompt, response, answer)``. A task that wants its rewards to see
more than the answer (the instance of a Countdown row, a reasoning-gym entry, the columns of a
dataset row) stores an :class:`Answer` (``value`` + ``meta``) as ``Example.answer``:
``str(Answer)`` is ``str(value)``, which is what the trainer, the audit and the rollout log
use, and a reward reads both parts back with :func:`unwrap`. :func:`wrap_meta` turns a reward
that takes ``meta=`` (or ``**kwargs``) into a 3-argument one that unwraps the Answer itself
(see :mod:`rlvr.tasks.dataset`).

Stdlib only; imports nothing from rlvr.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Answer", "unwrap", "accepts_meta", "wrap_meta"]


@dataclass(eq=False)
class Answer:
    """An answer that carries its row's other columns; ``str()`` is ``str(value)``."""

    value: Any
    meta: dict = field(default_factory=dict)

    def __str__(self) -> str:
        if isinstance(self.value, str):
            return self.value
        if isinstance(self.value, (dict, list)):
            return json.dumps(self.value, ensure_ascii=False, sort_keys=True)
        return str(self.value)

    def __eq__(self, other) -> bool:
        if isinstance(other, Answer):
            return self.value == other.value and self.meta == other.meta
        return NotImplemented

    def __hash__(self) -> int:
        return hash(str(self))


def unwrap(answer: Any) -> tuple[Any, dict]:
    """(value, meta) of an :class:`Answer`; (answer, {}) for anything else."""
    if isinstance(answer, Answer):
        return answer.value, answer.meta
    return answer, {}


def accepts_meta(fn: Callable) -> bool:
    """True when ``fn`` has a parameter named ``meta`` or a ``**kwargs``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == "meta" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        for p in params
    )


def wrap_meta(fn: Callable) -> Callable[[str, str, Any], Any]:
    """``fn`` as a 3-argument reward that unwraps :class:`Answer` and passes ``meta=`` if wanted."""
    with_meta = accepts_meta(fn)

    def wrapped(prompt: str, response: str, answer: Any):
        value, meta = unwrap(answer)
        if with_meta:
            return fn(prompt, response, value, meta=meta)
        return fn(prompt, response, value)

    wrapped.__name__ = getattr(fn, "__name__", "reward")
    wrapped.__doc__ = getattr(fn, "__doc__", None)
    wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapped
