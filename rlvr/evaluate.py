"""Held-out evaluation of the real goal (the training reward measures the proxy; the held-out goal measures the task).

- `goal`: fraction of held-out prompts whose greedy response meets the task's goal check.
- `reward`: mean optimised reward of those greedy responses (the proxy, for comparison).
- `pass@k` / `mean@k`: k responses sampled per prompt at the training temperature and top-p;
  pass@k is the fraction of prompts with at least one response meeting the goal (with n = k
  samples the unbiased estimator of Chen et al. reduces to this), mean@k the mean goal rate.
"""

from __future__ import annotations

import torch

from rlvr import sampling
from rlvr.rewards import goal_hits, score_batch
from rlvr.tasks import Task, weighted_rewards
from rlvr.tokenizer import encode_example


@torch.no_grad()
def _responses(model, tok, prompts: list, *, k: int, max_new_tokens: int, eos_id, temperature: float,
               top_p: float, batch_size: int, generator) -> list[str]:
    out: list[str] = []
    per_batch = max(1, batch_size // k)
    for i in range(0, len(prompts), per_batch):
        chunk = prompts[i:i + per_batch]
        roll = sampling.generate(model, [encode_example(tok, ex) for ex in chunk], samples_per_prompt=k,
                                 max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 eos_id=eos_id, pad_id=tok.pad_id, generator=generator)
        out.extend(tok.decode(r) for r in roll.response_ids.tolist())
    return out


def evaluate(model, tok, task: Task, *, reward_weights: dict[str, float], max_new_tokens: int, eos_id,
             prompts: int = 0, batch_size: int = 1000, pass_k: int = 0, pass_k_prompts: int = 200,
             temperature: float = 1.0, top_p: float = 1.0, seed: int = 0) -> dict:
    """Goal and reward of greedy responses on held-out prompts, plus pass@k when asked."""
    was_training = model.training
    model.eval()
    examples = list(task.heldout[:prompts] if prompts else task.heldout)
    texts = [ex.prompt for ex in examples]
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed + 12345)
    greedy = _responses(model, tok, examples, k=1, max_new_tokens=max_new_tokens, eos_id=eos_id,
                        temperature=0.0, top_p=1.0, batch_size=batch_size, generator=gen)
    goal, goal_failures, _ = goal_hits(task.goal, texts, greedy, [ex.answer for ex in examples])
    scored = score_batch(weighted_rewards(task, reward_weights), texts, greedy, [ex.answer for ex in examples])
    res = {
        "goal": sum(goal) / len(goal),
        "reward": sum(scored.total) / len(scored.total),
        "prompts": len(examples),
        "reward_failures": sum(v for k, v in scored.status_counts.items() if k != "ok"),
        "goal_failures": goal_failures,
    }
    if pass_k:
        sub = examples[:pass_k_prompts]
        sampled = _responses(model, tok, sub, k=pass_k, max_new_tokens=max_new_tokens,
                             eos_id=eos_id, temperature=temperature, top_p=top_p, batch_size=batch_size,
                             generator=gen)
        hits, _, _ = goal_hits(task.goal, [ex.prompt for ex in sub for _ in range(pass_k)], sampled,
                               [ex.answer for ex in sub for _ in range(pass_k)])
        per_prompt = [any(hits[i * pass_k:(i + 1) * pass_k]) for i in range(len(sub))]
        res[f"pass@{pass_k}"] = sum(per_prompt) / len(per_prompt)
        res[f"mean@{pass_k}"] = sum(hits) / len(hits)
    model.train(was_training)
    return res
