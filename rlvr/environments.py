"""Environments: a multi-turn task as an object per episode, stepped with the policy's turns.

The protocol (gymnasium's ``reset`` / ``step``, in text)::

    class Environment(Protocol):
        def reset(self, prompt: str, answer) -> None: ...
        def step(self, action: str) -> Step | tuple: ...     # (observation, reward, done)

A task gives ``Task.environment``, a class or function that makes one fresh environment per episode
(so each sampled row has its own). The example's prompt is the first observation (the task wrote it,
and the prompt encoding renders it); ``reset(prompt, answer)`` starts the episode from it. Each
*action* is one piece the policy sampled: it ends at a stop string (``sampling.stop``) or at the end
token. ``step(action)`` returns a :class:`Step`:

* ``observation``: text inserted after the action (attended, never trained on, as rlvr.tools inserts a
  tool's result; with ``sampling.tool_role`` as that role's chat turn), or None to end the episode
  there (as a tool's None);
* ``reward``: this turn's reward, or None (0.0); the per-turn rewards of an episode reach the per-token
  Δ through the ``turn_rewards`` process reward (:func:`turn_rewards`: the action's tokens get its
  turn's credit, rlvr.advantages.span_steps);
* ``done``: the episode is over; the response ends after this action.

Every finished action is stepped, the last one too: an action that ends at the end token without
``sampling.tool_on_end``, or after ``sampling.max_tool_calls`` observations were inserted, is stepped
with its observation dropped (the *closing step*), so the environment scores the end of the
episode (the calculator's final answer, the last guess). An action cut by ``max_new_tokens`` is not
stepped (its turn reward is 0.0).

Where environments run
----------------------
In the reward workers (rlvr.reward_pool), with the reward timeout, memory limit and statuses, like a
tool call; or in the trainer's process with ``task.reward_workers = 0``. A worker keeps no state between
calls (any worker serves any call; a killed one loses only its call), so each step rebuilds the
episode: a fresh environment, ``reset``, then the episode's earlier actions replayed, then the new one
(:func:`step_episode`). An environment must therefore be deterministic given (prompt, answer, actions),
as a reward is; its replay costs O(turns²) steps per episode, nothing for the few turns of a text game.
A step that raises, returns the wrong type, times out or kills its worker ends its row with that status
(counted in ``ToolStats.errors``, its first message logged); the run goes on.

What rewards see
----------------
An environment task's rewards and goal receive the response as an :class:`Episode`: a ``str`` (the
whole text, inserted observations included, as every reward reads it) that also keeps the turns:
``actions``, ``observations``, ``turn_rewards``, ``done`` and each action's token ``spans``. A reward that
wants the calls and their results reads them there (:func:`episode_of`); one that does not, sees text.

Gymnasium-style text environments
---------------------------------
:class:`GymText` adapts an environment with gymnasium's API (``reset(seed=) -> (obs, info)``,
``step(action) -> (obs, reward, terminated, truncated, info)``) whose observations and actions are text
(``gymnasium.spaces.Text``), and :func:`gym_examples` makes a task's examples from it: one per seed, the
prompt the observation ``reset(seed=seed)`` returns, the answer the seed. It needs no package (it
calls those two methods), so gymnasium is not a dependency. No adapter for a text-game package was
added: TextArena's environments are multi-player and step as ``step(action) -> (done, info)`` with the
rewards at ``close()``, and TextWorld, ALFWorld and Jericho bring game engines, game files or datasets
far heavier than this library's dependencies; their text games fit :class:`GymText` or this protocol
with a short wrapper in the task file.

Stdlib only; never imports the trainer or the config.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Protocol, Sequence

from rlvr.rewards import FLOAT32_MAX, Score, StepScores, guarded

__all__ = ["Environment", "Step", "Episode", "episode_of", "step_episode", "turn_rewards", "check_step", "GymText",
           "gym_examples", "episode_return"]


class Step(NamedTuple):
    """What one ``Environment.step`` returns."""

    observation: str | None
    """Text inserted after the action (None: the episode ends here)."""
    reward: float | None = None
    """This turn's reward (None: none, counted 0.0)."""
    done: bool = False
    """The episode is over after this action."""


class Environment(Protocol):
    """One episode's state: made fresh by ``Task.environment()`` for every sampled row."""

    def reset(self, prompt: str, answer: Any) -> None:
        """Start the episode whose first observation is ``prompt`` (``answer``: the example's)."""

    def step(self, action: str) -> Step | tuple:
        """Take the policy's ``action`` (one sampled piece, special tokens dropped)."""


class Episode(str):
    """A response in an environment: the whole text (a ``str``, what any reward reads) with its turns.

    ``actions[k]`` is the k-th sampled piece, ``spans[k]`` its (start, end) token offsets in the
    response; ``observations[k]`` what the environment answered to it (None: not stepped, or nothing);
    ``turn_rewards[k]`` its reward (None: none, or not stepped); ``done``: the environment ended it."""

    actions: tuple[str, ...]
    observations: tuple[str | None, ...]
    turn_rewards: tuple[float | None, ...]
    spans: tuple[tuple[int, int], ...]
    done: bool

    def __new__(cls, text: str, actions: Sequence[str] = (), observations: Sequence[str | None] = (),
                turn_rewards: Sequence[float | None] = (), spans: Sequence[tuple[int, int]] = (),
                done: bool = False) -> "Episode":
        obj = super().__new__(cls, text)
        obj.actions, obj.observations = tuple(actions), tuple(observations)
        obj.turn_rewards, obj.spans, obj.done = tuple(turn_rewards), tuple(map(tuple, spans)), bool(done)
        return obj

    def __reduce__(self):  # pickles with its turns (to the reward workers, to rollout workers)
        return (Episode, (str(self), self.actions, self.observations, self.turn_rewards, self.spans, self.done))

    def __repr__(self) -> str:
        return f"Episode({str(self)!r}, {len(self.actions)} actions, done={self.done})"


def episode_of(response: str) -> Episode | None:
    """The episode a reward was given, or None for a plain response (a task without environment)."""
    return response if isinstance(response, Episode) else None


def check_step(out: Any) -> Score:
    """The status of what ``step`` returned: ``ok`` with value ``[observation, reward, done]`` (JSON
    ready), else ``bad_type`` (not a 3-tuple of str or None, a number or None, a bool) or ``nan``."""
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        return Score(None, "bad_type", f"step returned {type(out).__name__} {out!r:.80}, not (observation, reward, "
                                       "done)")
    obs, reward, done = out
    if obs is not None and not isinstance(obs, str):
        return Score(None, "bad_type", f"the observation is a {type(obs).__name__}, not a str or None")
    if not isinstance(done, bool):
        return Score(None, "bad_type", f"done is a {type(done).__name__}, not a bool")
    if reward is not None:
        if isinstance(reward, (str, bytes, bool)) or not isinstance(reward, (int, float)):
            return Score(None, "bad_type", f"the reward is a {type(reward).__name__}, not a number or None")
        if not math.isfinite(reward) or abs(reward) > FLOAT32_MAX:
            return Score(None, "nan", f"the reward is {reward}")
        reward = float(reward)
    return Score([obs, reward, done], "ok")


def step_episode(make: Callable[[], Environment], prompt: str, episode: Episode, answer: Any, *,
                 interrupts: bool = False) -> Score:
    """Step a fresh environment ``make()`` through ``episode``: ``reset``, replay every action but the
    last, then step the last; as `rlvr.rewards.call_tool` runs a tool, never crashing the caller:
    ``Score([observation, reward, done], "ok")``, or value None with ``error`` (it raised), ``exit``
    (SystemExit; KeyboardInterrupt with ``interrupts``), ``bad_type`` or ``nan`` (`check_step`)."""
    def replay() -> Score:
        env = make()
        env.reset(prompt, answer)
        for action in episode.actions[:-1]:
            env.step(action)
        return check_step(env.step(episode.actions[-1]))

    stepped, failed = guarded(replay, None, interrupts=interrupts)
    return failed if failed is not None else stepped


def turn_rewards(prompt: str, response: str, answer: Any) -> StepScores | float:
    """The environment's rewards as a process reward: one step per action (its turn reward, 0.0 for
    None or an unstepped action), so each action's tokens get its turn's credit in the per-token Δ; the
    value is their mean. A plain response (no episode) scores 0.0."""
    ep = episode_of(response)
    if ep is None or not ep.actions:
        return 0.0
    return StepScores([0.0 if r is None else r for r in ep.turn_rewards])


def episode_return(prompt: str, response: str, answer: Any) -> float:
    """The sum of the environment's turn rewards (0.0 for a plain response): a goal such as
    ``episode_return(...) > 0`` reads it."""
    ep = episode_of(response)
    return 0.0 if ep is None else float(sum(r for r in ep.turn_rewards if r is not None))


class GymText:
    """A gymnasium-style text environment as an :class:`Environment`: ``GymText(make)`` with ``make()``
    returning an object with ``reset(seed=) -> (observation, info)`` and ``step(action) -> (observation,
    reward, terminated, truncated, info)``. The episode's answer is its seed (:func:`gym_examples`): reset
    checks that the observation is the example's prompt (the environment must be deterministic per seed).
    A step ends the episode when terminated or truncated; its observation is inserted otherwise."""

    def __init__(self, make: Callable[[], Any]):
        self.make = make

    def reset(self, prompt: str, answer: int) -> None:
        self.env = self.make()
        obs, _ = self.env.reset(seed=answer)
        if obs != prompt:
            raise ValueError(f"reset(seed={answer}) gave {obs!r:.60}, not the example's prompt {prompt!r:.60}: the "
                             "environment is not deterministic per seed")

    def step(self, action: str) -> Step:
        obs, reward, terminated, truncated, _ = self.env.step(action)
        return Step(None if obs is None else str(obs), float(reward), bool(terminated or truncated))


def gym_examples(make: Callable[[], Any], seeds: Sequence[int]) -> list:
    """One ``rlvr.tasks.Example`` per seed: the prompt is ``make().reset(seed=seed)``'s observation, the
    answer the seed (what :class:`GymText` resets with)."""
    from rlvr.tasks import Example   # rlvr.tasks imports rlvr.rewards, as this module does

    out = []
    for seed in seeds:
        obs, _ = make().reset(seed=seed)
        out.append(Example(prompt=str(obs), answer=seed, meta={"seed": seed}))
    return out
