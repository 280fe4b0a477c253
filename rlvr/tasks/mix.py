"""Several tasks trained as one: a weighted mixture of task families (verl's and TRL's data mixtures).

    [task]
    path = "rlvr.tasks.mix:mix_task"
    reward = "mixed"
    options = { tasks = [
        { path = "rlvr.tasks.arith:arith_task", options = { ops = "+", digits = 2 }, reward = "correct", weight = 2 },
        { path = "rlvr.tasks.countdown:countdown_task", reward = "correct" },
    ] }

Each component is loaded with ``load_task(path, **options)`` and contributes:

* training prompts in proportion to its ``weight`` (default 1): the mixture's training list holds
  ``round(N * weight / total weight)`` examples of each component, N being the components' training
  examples together, each component's own cycled in a shuffled order (``seed``) when its share is
  larger than its set, so a uniformly drawn prompt comes from a component with probability
  proportional to its weight;
* all its held-out examples (the mixture's held-out goal is over their union; ``eval.group_by =
  "task"`` logs each component's goal);
* its ``reward`` (the name of one of its rewards; may be left out when it has only one).

Every example's ``meta["task"]`` names its component (its task's name, or ``name`` when given;
repeated names get "#2", "#3") and its answer is a :class:`MixAnswer` that says which component
scores it: the mixture's one reward ``mixed`` and its goal call that component's reward and goal
with the component's own answer, as does its tool when the component has one. The response bound
is the largest component's; the components must all end their responses (no fixed-length task)
and share one step delimiter. Components are named by module (``package.module:NAME``), never by
file: a file path inside ``task.options`` would escape the check that keeps ``rlvr eval`` from
importing a task file a copied run directory names.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Example, Task, TaskError, is_file, load_task


@dataclass(frozen=True)
class MixAnswer:
    """An answer of a mixture's example: the component that scores it and the component's own answer."""

    task: int
    answer: Any

    def __str__(self) -> str:
        return str(self.answer)


def _component(i: int, spec: Any) -> tuple[Task, str, float, str]:
    """(task, reward name, weight, name) of the mixture's component `i` as configured."""
    where = f"mix_task: tasks[{i}]"
    if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
        raise TaskError(f"{where} must be a table with a task 'path' (and optional options, reward, weight, name), "
                        f"got {spec!r}")
    unknown = sorted(set(spec) - {"path", "options", "reward", "weight", "name"})
    if unknown:
        raise TaskError(f"{where}: unknown keys {unknown}; a component has path, options, reward, weight, name")
    path = spec["path"]
    if is_file(path.rpartition(":")[0] or path):
        raise TaskError(f"{where}: {path!r} is a file; name a component by module (package.module:NAME), so that "
                        f"rlvr eval's check on a run's task files covers it")
    options = spec.get("options", {})
    if not isinstance(options, dict):
        raise TaskError(f"{where}: options must be a table, got {options!r}")
    task = load_task(path, **options)
    if task.fixed_length:
        raise TaskError(f"{where}: {task.name} is a fixed-length task (no end token); a mixture's responses "
                        f"end at an end token, so its components must too")
    reward = spec.get("reward")
    if reward is None:
        if len(task.rewards) != 1:
            raise TaskError(f"{where}: {task.name} has rewards {sorted(task.rewards)}; say which with reward = ...")
        reward = next(iter(task.rewards))
    if reward not in task.rewards:
        raise TaskError(f"{where}: {task.name} has no reward {reward!r}; its rewards: {sorted(task.rewards)}")
    weight = spec.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise TaskError(f"{where}: weight must be a number > 0, got {weight!r}")
    return task, reward, float(weight), str(spec.get("name", task.name))


def _names(names: list[str]) -> list[str]:
    """The names with repeats made distinct: "arith", "arith#2", ..."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


def _weighted_train(tasks: list[Task], weights: list[float], names: list[str], seed: int) -> list[Example]:
    """The mixture's training list: component i's share round(N * w_i / sum w) of N = all training
    examples, its own examples shuffled and cycled to fill it (module docstring)."""
    rng = random.Random(seed)
    total, n = sum(weights), sum(len(t.train) for t in tasks)
    out = []
    for i, (task, w, name) in enumerate(zip(tasks, weights, names)):
        order = list(range(len(task.train)))
        rng.shuffle(order)
        share = max(1, round(n * w / total))
        for k in range(share):
            ex = task.train[order[k % len(order)]]
            out.append(Example(ex.prompt, MixAnswer(i, ex.answer), {**ex.meta, "task": name}))
    rng.shuffle(out)
    return out


def mix_task(tasks: list, seed: int = 0) -> Task:
    """The weighted mixture of ``tasks`` (a list of tables: path, options, reward, weight, name; see the
    module docstring). ``seed`` orders the training list."""
    if not isinstance(tasks, list) or not tasks:
        raise TaskError(f"mix_task: tasks must be a non-empty list of components, got {tasks!r}")
    parts = [_component(i, spec) for i, spec in enumerate(tasks)]
    comps = [p[0] for p in parts]
    rewards = [p[0].rewards[p[1]] for p in parts]
    names = _names([p[3] for p in parts])
    delims = {t.step_delimiter for t in comps}
    if len(delims) > 1:
        raise TaskError(f"mix_task: the components cut process-reward steps differently ({sorted(delims)}); "
                        f"a mixture has one step delimiter")

    def mixed(prompt: str, response: str, answer: MixAnswer) -> Any:
        return rewards[answer.task].fn(prompt, response, answer.answer)

    def goal(prompt: str, response: str, answer: MixAnswer) -> bool:
        return comps[answer.task].goal(prompt, response, answer.answer)

    envs = [n for n, t in zip(names, comps) if t.environment is not None]
    if envs:
        raise TaskError(f"mix_task: {', '.join(envs)} step an environment (Task.environment); a mixture takes "
                        "tasks with a tool or none, not environments")
    tools = [t.tool for t in comps]

    def tool(prompt: str, response: str, answer: MixAnswer) -> str | None:
        own = tools[answer.task]
        return None if own is None else own(prompt, response, answer.answer)

    card = RewardCard(
        pays_for="; ".join(f"{n}: {r.card.pays_for}" for n, r in zip(names, rewards)),
        ignores="; ".join(f"{n}: {r.card.ignores}" for n, r in zip(names, rewards)),
        exploit="; ".join(f"{n}: {r.card.exploit}" for n, r in zip(names, rewards)))
    alphabets = [t.alphabet for t in comps]
    return Task(
        name="mix(" + ", ".join(names) + ")",
        train=_weighted_train(comps, [p[2] for p in parts], names, seed),
        heldout=[Example(ex.prompt, MixAnswer(i, ex.answer), {**ex.meta, "task": names[i]})
                 for i, t in enumerate(comps) for ex in t.heldout],
        rewards={"mixed": Reward("mixed", mixed, card)},
        goal=goal,
        max_new_tokens=max(t.max_new_tokens for t in comps),
        alphabet=None if any(a is None for a in alphabets) else "".join(sorted(set("".join(alphabets)))),
        step_delimiter=delims.pop(),
        tool=tool if any(t is not None for t in tools) else None,
    )
