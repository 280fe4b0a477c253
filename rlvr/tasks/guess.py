"""A guessing game: a multi-turn environment. The policy guesses a secret whole number; after each
wrong guess the environment says whether the secret is higher or lower, and the policy guesses again.

Run it with ``sampling.tool_on_end = true`` and ``sampling.max_tool_calls = N`` (N + 1 guesses):
a guess ends at the end token, and the task's environment (``GuessGame``, rlvr.environments) reads
the guess and answers with the next turn, or ends the episode when the guess was right. Without
``tool_on_end`` it is a one-guess task (the guess is still stepped, for its turn reward).

Games
-----
Each example is one game: a key (a distinct number per game, so held-out games are disjoint from
training ones) and a secret in ``low..high`` derived from the key and ``seed`` by a hash, so no other
game tells it: only the feedback does.

Styles
------
* ``chat`` (default): "I am thinking of a whole number from 1 to 100 (game 4821). Guess it: reply
  with the number only. After a wrong guess I will say higher or lower." as one user message in
  ``Example.meta["messages"]`` (a chat model's template), feedback ``higher`` / ``lower``; use
  ``sampling.tool_role = "user"`` so each comes as a user turn.
* ``compact``: "4821?" and ``>`` / ``<`` (the secret is higher / lower), for the built-in
  character-level model (``tool_role = ""``: the feedback follows the end token inline).

Rewards and goal
----------------
The last whole number in the conversation is the last guess (the feedback holds no digits).

* ``guessed``: 1.0 when it is the secret, else 0.0. It pays the same for a win in one guess or in
  five; the number of guesses is bounded by ``max_tool_calls``.
* ``turns``: the environment's per-turn rewards (1.0 on the winning guess, 0.0 on the others) as a
  process reward: each guess's tokens are credited with their own turn (rlvr.environments.turn_rewards).

The goal is the same check: the episode ends on the secret.
"""

from __future__ import annotations

import functools
import random
import re

from rlvr.environments import Step, turn_rewards
from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Example, Task

CHAT_PROMPT = ("I am thinking of a whole number from {low} to {high} (game {key}). Guess it: reply with the number "
               "only. After a wrong guess I will say higher or lower.")
"""The chat style's prompt."""
FEEDBACK = {"chat": ("higher", "lower"), "compact": (">", "<")}
"""(the secret is higher, the secret is lower) in each style."""
NO_GUESS = {"chat": "Reply with a number.", "compact": "?"}
"""The environment's answer to a turn with no number in it."""
INTEGER = re.compile(r"-?\d+")


def secret(key: int, low: int, high: int, seed: int) -> int:
    """The game's secret: a hash of (key, seed) into low..high (other keys do not tell it)."""
    return low + ((key * 2654435761 + seed * 40503) % 2 ** 32 >> 7) % (high - low + 1)


def last_guess(response: str) -> int | None:
    """The last whole number in the conversation so far (None when there is none)."""
    found = INTEGER.findall(response)
    return int(found[-1]) if found else None


def guessed(prompt: str, response: str, answer: int) -> float:
    """1.0 when the last guess is the secret."""
    return 1.0 if last_guess(response) == answer else 0.0


def goal(prompt: str, response: str, answer: int) -> bool:
    return last_guess(response) == answer


def make_referee(style: str):
    """The environment of a style: None when the last guess is right (the episode ends), else the
    feedback (higher / lower), or a request for a number when the turn held none."""
    higher, lower = FEEDBACK[style]

    def referee(prompt: str, response: str, answer: int) -> str | None:
        guess = last_guess(response)
        if guess is None:
            return NO_GUESS[style]
        return None if guess == answer else (higher if answer > guess else lower)

    referee.__name__ = f"referee_{style}"
    return referee


class GuessGame:
    """One game as an environment (rlvr.environments): each action is a guess; the step answers it as the
    referee does (higher / lower, a request for a number), ends the episode with reward 1.0 on the
    secret, and gives 0.0 for a wrong guess."""

    def __init__(self, style: str = "chat"):
        self.referee = make_referee(style)

    def reset(self, prompt: str, answer: int) -> None:
        self.prompt, self.secret = prompt, answer

    def step(self, action: str) -> Step:
        feedback = self.referee(self.prompt, action, self.secret)
        return Step(None, 1.0, True) if feedback is None else Step(feedback, 0.0, False)


def guess_task(low: int = 1, high: int = 100, heldout: int = 200, train: int = 5000, seed: int = 0,
               style: str = "chat", max_new_tokens: int = 0) -> Task:
    """Games of guessing a whole number in ``low..high``: ``heldout`` + ``train`` distinct keys drawn
    with ``seed``; ``max_new_tokens`` 0 = 64 (chat) or 16 (compact), the whole conversation's bound."""
    if style not in FEEDBACK:
        raise ValueError(f"guess_task: style must be one of {sorted(FEEDBACK)}, got {style!r}")
    for k, v in (("low", low), ("high", high), ("heldout", heldout), ("train", train), ("max_new_tokens", max_new_tokens)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"guess_task: {k} must be an int, got {v!r}")
    if not 0 <= low < high or heldout < 1 or train < 1 or max_new_tokens < 0:
        raise ValueError(f"guess_task: need 0 <= low < high, heldout >= 1, train >= 1, max_new_tokens >= 0; got "
                         f"low={low}, high={high}, heldout={heldout}, train={train}, max_new_tokens={max_new_tokens}")
    keys = random.Random(seed).sample(range(1000, 10000), heldout + train) if heldout + train <= 9000 else None
    if keys is None:
        raise ValueError(f"guess_task: at most 9000 games (4-digit keys), got heldout + train = {heldout + train}")

    def example(key: int) -> Example:
        text = CHAT_PROMPT.format(low=low, high=high, key=key) if style == "chat" else f"{key}?"
        meta = {"key": key, "messages": [{"role": "user", "content": text}]} if style == "chat" else {"key": key}
        return Example(prompt=text, answer=secret(key, low, high, seed), meta=meta)

    card = RewardCard(
        pays_for="a conversation whose last guess (its last whole number) is the secret",
        ignores="how many guesses it took (bounded by sampling.max_tool_calls) and anything said besides numbers",
        exploit="none known that fails the goal: it is the goal's own check. Several numbers in one turn count as "
                "their last; the environment answers that one",
        exploit_example=None)
    turns = RewardCard(
        pays_for="each guess: 1.0 for the guess that hits the secret (the episode ends there), 0.0 for the others, "
                 "as the environment scored them (a process reward: each guess's tokens get its own turn's credit)",
        ignores="anything in a turn but its last whole number; guesses after the last one the environment stepped",
        exploit="none known that fails the goal: the winning turn is the goal's own check on that guess",
        exploit_example=None)
    return Task(name=f"guess-{low}-{high}-{style}", train=[example(k) for k in keys[heldout:]],
                heldout=[example(k) for k in keys[:heldout]],
                rewards={"guessed": Reward("guessed", guessed, card), "turns": Reward("turns", turn_rewards, turns)},
                goal=goal, max_new_tokens=max_new_tokens or (64 if style == "chat" else 16),
                alphabet=None if style == "chat" else "0123456789?<>", environment=functools.partial(GuessGame, style))


TASK = guess_task
