"""Held-out evaluation of the real goal: the training loss says little in RL, so read the goal on
prompts the policy never trained on.

- `goal`: fraction of held-out prompts whose greedy response meets the task's goal check.
- `reward`: mean optimised reward of those greedy responses (the proxy, for comparison).
- `pass@k` / `mean@k`: k responses sampled per prompt at the training temperature and top-p;
  pass@k is the fraction of prompts with at least one response meeting the goal (with n = k
  samples the unbiased estimator of Chen et al. reduces to this), mean@k the mean goal rate.
- `tool_calls_per_response`, `tool_errors`: with tool calls on (rlvr.tools), of the greedy responses.
- `goal_by_<key>/<value>`, `prompts_by_<key>/<value>`: with `group_by`, the goal of each group of
  held-out prompts sharing that value of their meta's key (`goal_by_groups`).
"""

from __future__ import annotations

import contextlib

import torch

from rlvr.policy import Policy, Tokenizer
from rlvr.groups import sample_and_score
from rlvr.setup_types import Limits
from rlvr.tasks import Task

MAX_GROUPS = 50
"""Most groups `goal_by_groups` reports (the largest; ties broken by value)."""
NO_VALUE = "(none)"
"""The group of examples whose meta lacks the key."""


def evaluate(model: Policy, tok: Tokenizer, task: Task, *, reward_weights: dict[str, float], limits: Limits,
             prompts: int = 0, batch_size: int = 1000, pass_k: int = 0, pass_k_prompts: int = 200,
             temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, pool=None,
             autocast=contextlib.nullcontext, top_k: int = 0, min_p: float = 0.0, group_by: str = "",
             hits: bool = False) -> dict:
    """Goal and reward of greedy responses on held-out prompts, plus pass@k when asked.

    ``pool``: a :class:`rlvr.reward_pool.RewardPool` holding this task scores the responses in its
    workers (time- and memory-limited, in parallel); None scores in this process. ``autocast()``: the
    context the sampling forwards run in (a training run's numerics, rlvr.numerics.Numerics.context).
    ``group_by``: also the goal per value of that meta key (`goal_by_groups`). ``hits``: also each
    prompt's greedy hit, 1 or 0 in the held-out order (``"hits"``), so that two models evaluated on
    the same prompts can be compared prompt by prompt (a paired difference, whose noise is smaller
    than two independent accuracies' where the models tend to get the same prompts right)."""
    was_training = model.training
    model.eval()
    examples = list(task.heldout[:prompts] if prompts else task.heldout)
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed + 12345)
    greedy = sample_and_score(model, tok, task, examples, G=1, limits=limits, weights=reward_weights,
                              temperature=0.0, top_p=1.0, generator=gen, chunk_prompts=max(1, batch_size), pool=pool,
                              autocast=autocast)
    hit = greedy.hits.view(-1).tolist()                       # each prompt's greedy hit, held-out order
    res = {
        "goal": _mean(hit),
        "reward": _mean(greedy.totals),
        "prompts": len(examples),
        "reward_failures": greedy.reward_failures,
        "goal_failures": greedy.goal_failures,
    }
    if hits:
        res["hits"] = [int(bool(h)) for h in hit]
    if group_by:
        res.update(goal_by_groups(examples, hit, group_by))
    if greedy.tools is not None:  # how the greedy responses used the task's tool (rlvr.tools)
        res["tool_calls_per_response"] = greedy.tools.calls / len(examples)
        res["tool_errors"] = greedy.tools.errors
        res["tool_malformed"] = greedy.tools.malformed
    if pass_k:
        sampled = sample_and_score(model, tok, task, examples[:pass_k_prompts], G=pass_k, limits=limits,
                                   weights=reward_weights, temperature=temperature, top_p=top_p, top_k=top_k,
                                   min_p=min_p, generator=gen,
                                   chunk_prompts=max(1, batch_size // pass_k), pool=pool, autocast=autocast)
        res[f"pass@{pass_k}"] = _mean(sampled.hits.any(dim=1).tolist())
        res[f"mean@{pass_k}"] = _mean(sampled.hits.view(-1).tolist())
    model.train(was_training)
    return res


def group_value(example, key: str) -> str:
    """The example's meta value for `key` as text (NO_VALUE when it has none)."""
    meta = example.meta if isinstance(example.meta, dict) else {}
    return str(meta[key]) if key in meta else NO_VALUE


def goal_by_groups(examples: list, hits: list, key: str) -> dict:
    """{goal_by_<key>/<value>: goal rate, prompts_by_<key>/<value>: count} over the MAX_GROUPS
    largest groups of `examples` by `group_value(example, key)`; `hits[i]` is example i's goal."""
    groups: dict[str, list] = {}
    for ex, h in zip(examples, hits):
        groups.setdefault(group_value(ex, key), []).append(float(h))
    largest = sorted(groups, key=lambda v: (-len(groups[v]), v))[:MAX_GROUPS]
    out = {}
    for v in sorted(largest):
        out[f"goal_by_{key}/{v}"] = _mean(groups[v])
        out[f"prompts_by_{key}/{v}"] = len(groups[v])
    return out


def _mean(xs: list) -> float:
    return sum(xs) / len(xs)
