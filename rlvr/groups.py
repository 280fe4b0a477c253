"""Scored groups: `sample_and_score` samples G responses per prompt, decodes and scores them, and
returns the `Groups` (P prompts x G responses, rows grouped). It is the one path from prompts to
scored responses: training (rlvr.rollout), evaluation and the probe all call it, so responses are
decoded and scored the same way everywhere."""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field

import torch

from rlvr import costs, sampling, scoring, tools
from rlvr.environments import Episode
from rlvr.policy import Policy, Tokenizer
from rlvr.rewards import goal_hits, score_batch
from rlvr.setup_types import Limits, RunError
from rlvr.tasks import Task, weighted_rewards
from rlvr.tokenizer import encode_examples


@dataclass
class Groups:
    """Scored groups: P' prompts x G responses, rows grouped (row b is prompt b // G)."""

    examples: list
    rollout: sampling.Rollout
    responses: list[str]
    rewards: torch.Tensor            # (P', G) optimised reward
    hits: torch.Tensor               # (P', G) bool, the goal (logged, never trained on)
    per_reward: dict[str, list[float]]
    failures: int
    """Reward and goal calls that did not return a usable value (scored 0 / counted as a miss)."""
    status_counts: dict[str, int]
    """Reward statuses over all calls, plus `goal_error` for goal checks that raised."""
    errors: list[str]
    totals: list[float] = field(default_factory=list)
    """Per row, the weighted reward as scored (Python floats; `rewards` holds them in float32)."""
    tools: tools.ToolStats | None = None
    """What the tool loop did (rlvr.tools), when the run calls the task's tool; its forward_tokens
    are the whole sampling call's."""
    score_s: float = 0.0
    """Seconds `sample_and_score` spent turning the responses into text and scoring them (the
    rewards and the goal: `score_groups`), after sampling."""

    @property
    def goal_failures(self) -> int:
        return self.status_counts.get("goal_error", 0)

    @property
    def reward_failures(self) -> int:
        return sum(v for k, v in self.status_counts.items() if k not in ("ok", "goal_error"))

    def select(self, groups: torch.Tensor, G: int) -> "Groups":
        """The groups at indices `groups` (a (k,) long tensor), rows kept together."""
        rows = (groups[:, None] * G + torch.arange(G)).reshape(-1)
        return Groups(
            examples=[self.examples[i] for i in groups.tolist()], rollout=self.rollout.select(rows),
            responses=[self.responses[i] for i in rows.tolist()], rewards=self.rewards[groups], hits=self.hits[groups],
            per_reward={k: [v[i] for i in rows.tolist()] for k, v in self.per_reward.items()},
            failures=self.failures, status_counts=self.status_counts, errors=self.errors,
            totals=[self.totals[i] for i in rows.tolist()] if self.totals else [], tools=self.tools,
            score_s=self.score_s,
        )


def merge(parts: list[Groups], pad_id: int) -> Groups:
    """Concatenate the groups of several sampling calls (dynamic sampling's rounds, evaluation chunks)."""
    return Groups(
        examples=[ex for p in parts for ex in p.examples],
        rollout=sampling.concat([p.rollout for p in parts], pad_id),
        responses=[r for p in parts for r in p.responses],
        rewards=torch.cat([p.rewards for p in parts]), hits=torch.cat([p.hits for p in parts]),
        per_reward={k: [v for p in parts for v in p.per_reward[k]] for k in parts[0].per_reward},
        failures=sum(p.failures for p in parts),
        status_counts={k: sum(p.status_counts.get(k, 0) for p in parts) for k in parts[0].status_counts},
        errors=[e for p in parts for e in p.errors][:5],
        totals=[t for p in parts for t in p.totals],
        tools=None if parts[0].tools is None else functools.reduce(tools.ToolStats.add, (p.tools for p in parts)),
        score_s=sum(p.score_s for p in parts),
    )


def total_overflow(weights: dict[str, float], per_reward: dict[str, list[float]], totals: list[float]) -> str:
    """Why a weighted reward total is not finite in float32 (each reward's own value is checked when it
    is received, rlvr.rewards.check_value): the largest total, and each reward's weight and largest value."""
    worst = max(totals, key=lambda t: abs(t) if t == t else float("inf"))
    parts = ", ".join(f"{name} (weight {weights.get(name, 1.0):g}, largest value {max(map(abs, vals), default=0):g})"
                      for name, vals in per_reward.items())
    return (f"a response's weighted reward is {worst:g}, beyond the float32 range (±3.4e38) rewards are trained "
            f"in: {parts}; lower task.reward_weights or the rewards' scale")


def score_groups(task: Task, weights: dict[str, float], examples: list, responses: list[str], G: int,
                 pool=None) -> tuple[torch.Tensor, torch.Tensor, dict, int, dict, list, list]:
    """Rewards (P, G), goal hits (P, G) and the bookkeeping of scoring `responses` (G per example),
    in the order of `Groups`' fields."""
    prompts = [ex.prompt for ex in examples for _ in range(G)]
    answers = [ex.answer for ex in examples for _ in range(G)]
    scored = score_batch(weighted_rewards(task, weights), prompts, responses, answers, pool=pool)
    hits, goal_failures, goal_errors = goal_hits(task.goal, prompts, responses, answers, pool=pool)
    rewards = torch.tensor(scored.total, dtype=torch.float32)
    if not bool(torch.isfinite(rewards).all()):
        raise RunError(total_overflow(weights, scored.per_reward, scored.total))
    return (rewards.view(-1, G), torch.tensor(hits).view(-1, G),
            scored.per_reward, scored.failed + goal_failures, {**scored.status_counts, "goal_error": goal_failures},
            list(scored.errors) + goal_errors, scored.total)


@torch.no_grad()
def sample_and_score(policy: Policy, tok: Tokenizer, task: Task, examples: list, *, G: int, limits: Limits,
                     weights: dict[str, float], temperature: float, top_p: float,
                     generator: torch.Generator | None, chunk_prompts: int = 0, pool=None,
                     base_seed: int | None = None, first_prompt: int = 0,
                     autocast=contextlib.nullcontext, top_k: int = 0, min_p: float = 0.0) -> Groups:
    """Sample G responses per example (temperature 0 = greedy), decode them and score them.

    A response is decoded up to its end token when the task has one (`limits.eos_id`), and in full
    on fixed-length tasks; with stop strings (`limits.stop`) up to and including the token that
    completed one; with tool calls (`limits.tool_calls` > 0, the task's `tool`, rlvr.tools) the whole
    response, inserted results included. `chunk_prompts` > 0 samples that many prompts per generate call (memory);
    the draws come from `generator` in order, so chunking does not change them. `pool`: a
    rlvr.reward_pool.RewardPool scores in its supervised workers (None: in this process).
    Sampling is seeded per prompt (rlvr.sampling.prompt_generators): one base seed is drawn from
    `generator` per call, or given as `base_seed` with this call's `first_prompt` index (a rollout
    worker's shard), so a prompt's rows do not depend on how the call's prompts are split.
    `autocast()`: the context the sampling forwards run in (rlvr.numerics.Numerics.context; the
    log-softmax of the sampling distribution is taken in float32 either way)."""
    if base_seed is None and generator is not None:
        base_seed = sampling.draw_base_seed(generator)
    device = next(iter(policy.parameters())).device
    gens = (sampling.prompt_generators(base_seed, first_prompt, len(examples), device)
            if base_seed is not None else None)
    step = chunk_prompts or len(examples)
    stop = sampling.StopStrings(limits.stop, tok.decode) if limits.stop else None
    kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    env = task.environment
    rollouts, tool_stats, turns = [], tools.ToolStats() if limits.tool_calls or env is not None else None, []
    for i in range(0, len(examples), step):
        chunk = examples[i:i + step]
        keep = [] if tool_stats is not None else None   # tool continuations reuse the KV cache (rlvr.tools)
        with autocast():
            r = sampling.generate(
                policy, encode_examples(tok, chunk), samples_per_prompt=G,
                max_new_tokens=limits.max_new_tokens, eos_id=limits.eos_id, pad_id=tok.pad_id,
                generators=gens[i:i + step] if gens else None, stop=stop, keep=keep,
                reserve=2 * limits.max_new_tokens * limits.tool_calls, **kw)
        if tool_stats is not None:  # answer the tool calls or step the environments, and sample on (rlvr.tools)
            first_fwd = costs.sampling_forward_tokens(len(chunk), r.prompt_len, *r.mask.shape)
            loop_kw = dict(max_new_tokens=limits.max_new_tokens, eos_id=limits.eos_id, stop=limits.stop,
                           max_calls=limits.tool_calls, base_seed=base_seed, first_row=(first_prompt + i) * G,
                           sample_kw=kw, autocast=autocast, pool=pool, role=limits.tool_role,
                           on_end=limits.tool_on_end, decoding=keep[0] if keep else None)
            rows = [ex for ex in chunk for _ in range(G)]
            if env is not None:
                r, st, got = tools.respond_in_environment(policy, tok, r, rows, env, **loop_kw)
                turns += got
            else:
                r, st = tools.respond_with_tools(policy, tok, r, rows, task.tool, **loop_kw)
            tool_stats = tool_stats.add(st)
            tool_stats.forward_tokens += first_fwd
        rollouts.append(r)
    rollout = rollouts[0] if len(rollouts) == 1 else sampling.concat(rollouts, tok.pad_id)
    t0 = time.perf_counter()
    # each row up to its last token, inserted text included (a chat turn inserted by a tool holds eos):
    # decode drops special tokens, so a final eos is not in the text
    extent = scoring.response_extent(rollout.attention_mask[:, rollout.prompt_len:]).tolist()
    responses = [tok.decode(r[:n]) for r, n in zip(rollout.response_ids.tolist(), extent)]
    if env is not None:  # the rewards and the goal see each episode's turns (rlvr.environments)
        responses = [Episode(text, **t) for text, t in zip(responses, turns)]
    scored = score_groups(task, weights, examples, responses, G, pool)
    return Groups(examples, rollout, responses, *scored, tools=tool_stats, score_s=time.perf_counter() - t0)
