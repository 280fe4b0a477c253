"""One prompt with its answer: the unit of every task's train and held-out splits.

Its own module so that both :mod:`rlvr.rewards` (a card's ``exploit_example`` takes one) and
:mod:`rlvr.tasks` (the task contract) can import it without importing each other;
``from rlvr.tasks import Example`` is the usual spelling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Example"]


@dataclass
class Example:
    """One prompt with the answer the rewards and the goal compare against."""

    prompt: str
    answer: Any
    meta: dict = field(default_factory=dict)
    """Anything else a task wants to keep beside the example (difficulty, source id...)."""
