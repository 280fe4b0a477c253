"""The GRPO loop of seed 000, top to bottom. The only module that wires the others together.

One step:
  1. Sample P training prompts; sample G responses each from π_old (the current weights, no grad).
  2. Score every response with the task's reward (a deterministic program); failures are counted.
  3. Turn the (P, G) reward matrix into Δ with the configured scheme (rlvr.advantages).
  4. Store logp_old: the per-token log-probs the sampler computed under the distribution it
     actually sampled from (temperature, top-p). Detached; no second model copy is kept.
  5. With the KL term on, compute logp_ref under the frozen reference policy.
  6. μ passes over the same rollouts, each split into minibatches: recompute logp, form the ratio
     against logp_old, clip, add β·KL, backprop, clip the gradient norm, AdamW step.
  7. π_old becomes the new weights (the next step samples from them); π_ref is refreshed every
     `algorithm.ref_refresh_every` steps (0 = never).
Held-out evaluation of the real goal runs every `eval.every` steps and at the end.

Departures from the GRPO paper, each a config field:
  1. The loss is reduced with `algorithm.agg` (default `token_mean`, as DAPO), not the paper's
     per-sequence mean; see rlvr.losses.AGGREGATIONS.
  2. logp_old is the sampler's own log-prob (same model code, same distribution) rather than a
     fresh forward pass; the two agree to float rounding, which a test checks.
"""

from __future__ import annotations

import copy
import json
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlvr import advantages, config as config_mod, costs, losses, sampling
from rlvr.evaluate import evaluate
from rlvr.models.tiny import TinyConfig, TinyTransformer
from rlvr.rewards import score_batch
from rlvr.tasks import Task, load_task, weighted_rewards
from rlvr.tokenizer import CharTokenizer


class RunError(RuntimeError):
    """A run that cannot start or continue, with the reason."""


@dataclass
class Setup:
    """Everything a run needs, built and checked before any compute."""

    cfg: config_mod.Config
    task: Task
    tokenizer: CharTokenizer
    model: TinyTransformer
    reward_weights: dict[str, float]
    max_new_tokens: int
    eos_id: int | None


def reward_weights(cfg: config_mod.Config, task: Task) -> dict[str, float]:
    """{reward name: weight} the run optimises; names checked against the task."""
    weights = dict(cfg.task.reward_weights) or {cfg.task.reward: 1.0}
    for name in weights:
        if name not in task.rewards:
            key = "task.reward_weights" if cfg.task.reward_weights else "task.reward"
            raise RunError(f"{key}: task {task.name!r} has no reward {name!r}; it has {', '.join(task.rewards)}")
    return {k: float(v) for k, v in weights.items()}


def build(cfg: config_mod.Config) -> Setup:
    """Load the task, build tokenizer and model; every error here comes before any compute."""
    task = load_task(cfg.task.path, **cfg.task.options)
    weights = reward_weights(cfg, task)
    max_new = cfg.sampling.max_new_tokens or task.max_new_tokens
    if cfg.model.init:
        init = Path(cfg.model.init)
        if not (init / "model.safetensors").is_file() or not (init / "tokenizer.json").is_file():
            raise RunError(f"model.init = {cfg.model.init!r}: expected model.safetensors and tokenizer.json there")
        tokenizer = CharTokenizer.load(init / "tokenizer.json")
        model = TinyTransformer.from_pretrained(init)
    else:
        alphabet = task.alphabet or "".join(sorted({c for ex in list(task.train) + list(task.heldout) for c in ex.prompt + str(ex.answer)}))
        tokenizer = CharTokenizer(alphabet)
        longest = max(len(tokenizer.encode(ex.prompt)) for ex in list(task.heldout) + list(task.train))
        torch.manual_seed(cfg.train.seed)
        model = TinyTransformer(TinyConfig(
            vocab_size=tokenizer.vocab_size, n_layer=cfg.model.n_layer, n_head=cfg.model.n_head,
            n_embd=cfg.model.n_embd, block_size=longest + max_new + 1,
        ))
    for ex in task.heldout[:1]:
        tokenizer.encode(ex.prompt)  # an alphabet that misses prompt characters fails here
    eos_id = tokenizer.eos_id if not task.fixed_length else None
    return Setup(cfg, task, tokenizer, model, weights, max_new, eos_id)


def price_of(setup: Setup) -> costs.Price:
    cfg = setup.cfg
    return costs.price(
        prompts_per_step=cfg.train.prompts_per_step, samples_per_prompt=cfg.train.samples_per_prompt,
        max_new_tokens=setup.max_new_tokens,
        prompt_tokens=max(len(setup.tokenizer.encode(ex.prompt)) for ex in list(setup.task.train) + list(setup.task.heldout)),
        steps=cfg.train.steps, epochs_per_batch=cfg.train.epochs_per_batch, minibatches=cfg.train.minibatches,
        n_params=setup.model.num_params(), has_reference=cfg.algorithm.kl_coef > 0,
    )


def lr_at(cfg: config_mod.TrainConfig, opt_step: int, total: int) -> float:
    """Learning-rate multiplier: linear warm-up, then constant / cosine / linear decay to 10%."""
    if cfg.warmup_steps and opt_step < cfg.warmup_steps:
        return (opt_step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    frac = (opt_step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    if cfg.lr_schedule == "cosine":
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return 1.0 - 0.9 * min(1.0, frac)


def prepare_out_dir(out: Path, *, overwrite: bool) -> None:
    """Refuse to write into an existing run unless told; nothing is deleted otherwise."""
    if out.exists() and not out.is_dir():
        raise RunError(f"--out {out} is a file, not a directory; choose another path")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise RunError(f"--out {out} already holds files; pass --overwrite to replace them, or choose another directory")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def train(cfg: config_mod.Config, out: Path, *, overwrite: bool = False, log=print) -> dict:
    """Run the loop; write config.toml, metrics.jsonl, rollouts.jsonl, checkpoint/, summary.json."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    setup = build(cfg)
    price = price_of(setup)
    prepare_out_dir(out, overwrite=overwrite)
    (out / "config.toml").write_text(config_mod.to_toml(cfg))
    for line in price.lines():
        log(line)

    t_start = time.perf_counter()
    task, tok, model = setup.task, setup.tokenizer, setup.model
    tc, ac, sc = cfg.train, cfg.algorithm, cfg.sampling
    P, G = tc.prompts_per_step, tc.samples_per_prompt
    rng = random.Random(tc.seed)
    gen = torch.Generator().manual_seed(tc.seed)
    torch.manual_seed(tc.seed)

    ref = None
    if ac.kl_coef > 0:
        ref = copy.deepcopy(model).requires_grad_(False).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)
    total_opt_steps = tc.steps * tc.epochs_per_batch * tc.minibatches
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(tc, s, total_opt_steps))
    metrics_f = open(out / "metrics.jsonl", "w")
    rollouts_f = open(out / "rollouts.jsonl", "w")
    sampled_tokens = 0
    last_eval: dict = {}

    def write_metrics(row: dict) -> None:
        metrics_f.write(json.dumps(row) + "\n")
        metrics_f.flush()

    def run_eval(step: int) -> dict:
        model.eval()
        res = evaluate(model, tok, task, reward_weights=setup.reward_weights, max_new_tokens=setup.max_new_tokens,
                       eos_id=setup.eos_id, prompts=cfg.eval.prompts, batch_size=cfg.eval.batch_size,
                       pass_k=cfg.eval.pass_k, pass_k_prompts=cfg.eval.pass_k_prompts,
                       temperature=sc.temperature, top_p=sc.top_p, seed=tc.seed)
        row = {"step": step, **{f"eval/{k}": v for k, v in res.items()}}
        write_metrics(row)
        return row

    for step in range(1, tc.steps + 1):
        t0 = time.perf_counter()
        # 1. sample P prompts and G responses each from π_old (the current weights)
        batch = [task.train[i] for i in rng.sample(range(len(task.train)), P)]
        model.eval()
        rollout = sampling.generate(
            model, [tok.encode(ex.prompt) for ex in batch], samples_per_prompt=G,
            max_new_tokens=setup.max_new_tokens, temperature=sc.temperature, top_p=sc.top_p,
            eos_id=setup.eos_id, pad_id=tok.pad_id, generator=gen,
        )
        t_sample = time.perf_counter() - t0
        mask = rollout.mask                                              # (B, T)
        sampled_tokens += int(mask.sum())
        responses = [tok.decode(r) for r in rollout.response_ids.tolist()]

        # 2. score (rows are grouped: row b is prompt b // G)
        scored = score_batch(weighted_rewards(task, setup.reward_weights), [ex.prompt for ex in batch for _ in range(G)],
                             responses, [ex.answer for ex in batch for _ in range(G)])
        rewards = torch.tensor(scored.total, dtype=torch.float32).view(P, G)     # (P, G)

        # 3. Δ from the reward matrix
        delta = advantages.compute(rewards, ac.scheme, top_k=ac.top_k or None)  # (P, G)
        delta_rows = delta.reshape(-1)                                           # (B,)

        # 4./5. logp_old stored and detached; logp_ref under the frozen reference
        logp_old = rollout.logp.detach()                                         # (B, T)
        logp_ref = None
        if ref is not None:
            with torch.no_grad():
                # the reference is scored without a nucleus: a token outside π_ref's own nucleus would get the
                # floor log-prob and a huge, meaningless KL (see rlvr.sampling.OUTSIDE_NUCLEUS_LOGP)
                logp_ref = sampling.sequence_token_logprobs(ref, rollout, temperature=sc.temperature, top_p=1.0)

        # 6. μ passes of minibatch gradient steps on the same rollouts
        model.train()
        B = P * G
        stats_acc: dict[str, float] = {}
        first_ratio = 1.0
        n_mb = 0
        for epoch in range(tc.epochs_per_batch):
            perm = torch.randperm(B, generator=gen) if tc.minibatches > 1 else torch.arange(B)
            for idx in perm.chunk(tc.minibatches):
                sub = rollout.select(idx)
                logp = sampling.sequence_token_logprobs(model, sub, temperature=sc.temperature, top_p=sc.top_p)
                loss, stats = losses.policy_loss(
                    logp, logp_old[idx], delta_rows[idx], sub.mask, clip_eps=ac.clip_eps,
                    clip_eps_high=ac.clip_eps_high or None, level=ac.ratio_level, agg=ac.agg,
                    max_len=setup.max_new_tokens,
                )
                if logp_ref is not None:
                    kl = losses.kl_loss(logp, logp_ref[idx], sub.mask, estimator=ac.kl_estimator, agg=ac.agg,
                                        max_len=setup.max_new_tokens)
                    loss = loss + ac.kl_coef * kl
                    stats["kl_ref"] = kl.item()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip if tc.grad_clip > 0 else float("inf"))
                opt.step()
                lr_used = sched.get_last_lr()[0]
                sched.step()
                stats["loss"] = loss.item()
                stats["grad_norm"] = float(gnorm)
                for k, v in stats.items():
                    stats_acc[k] = stats_acc.get(k, 0.0) + v
                if n_mb == 0:  # the first optimizer step of a batch sees π = π_old: ratio 1
                    first_ratio = stats["ratio_mean"]
                n_mb += 1

        # 7. π_old is now the updated model; refresh π_ref when due
        if ref is not None and ac.ref_refresh_every and step % ac.ref_refresh_every == 0:
            ref.load_state_dict(model.state_dict())

        agree = advantages.agreeing_groups(rewards)
        row = {
            "step": step,
            "train/reward": float(rewards.mean()),
            "train/goal": _goal_rate(task, batch, responses, G),
            "train/nonzero_delta_frac": advantages.nonzero_fraction(delta),
            "train/agreeing_groups_frac": float(agree.float().mean()),
            "train/response_len": float(mask.sum(1).mean()),
            # -logp of the sampled tokens is an unbiased estimate of the per-token sampling entropy
            "train/entropy": float(-(logp_old * mask).sum() / mask.sum().clamp(min=1)),
            "train/truncated_frac": float(rollout.truncated.float().mean()),
            "train/reward_failures": sum(v for k, v in scored.status_counts.items() if k != "ok"),
            "train/lr": lr_used,
            "train/sampled_tokens": sampled_tokens,
            "time/sample_s": t_sample,
            "time/step_s": time.perf_counter() - t0,
            "train/first_step_ratio_mean": first_ratio,
            **{f"train/{k}": v / n_mb for k, v in stats_acc.items()},
        }
        for name, vals in scored.per_reward.items():
            row[f"train/reward_{name}"] = sum(vals) / len(vals)
        write_metrics(row)
        if row["train/reward_failures"]:
            log(f"warning: step {step}: {row['train/reward_failures']} reward calls failed: {scored.status_counts}"
                + (f"; first error: {scored.errors[0]}" if scored.errors else ""))
        for g in range(min(cfg.log.rollouts_per_step, P)):
            rows = range(g * G, (g + 1) * G)
            rollouts_f.write(json.dumps({
                "step": step, "prompt": batch[g].prompt, "answer": str(batch[g].answer),
                "responses": [responses[b] for b in rows], "rewards": rewards[g].tolist(),
                "delta": delta[g].tolist(),
            }) + "\n")
        rollouts_f.flush()

        if cfg.eval.every and step % cfg.eval.every == 0 and step != tc.steps:
            last_eval = run_eval(step)
        if step % max(1, cfg.log.print_every) == 0 or step == 1:
            ev = f" | eval/goal {last_eval['eval/goal']:.3f}" if last_eval else ""
            log(f"step {step:>5}/{tc.steps} | reward {row['train/reward']:.3f} | goal {row['train/goal']:.3f} "
                f"| nonzero Δ {row['train/nonzero_delta_frac']:.2f} | agree {row['train/agreeing_groups_frac']:.2f} | H {row['train/entropy']:.2f}"
                f"{ev} | {time.perf_counter() - t_start:.1f}s")

    wall = time.perf_counter() - t_start
    last_eval = run_eval(tc.steps)
    log(f"final eval: goal {last_eval['eval/goal']:.4f} reward {last_eval['eval/reward']:.4f} "
        f"on {last_eval['eval/prompts']} held-out prompts")
    save_checkpoint(out / "checkpoint", model, tok)
    metrics_f.close()
    rollouts_f.close()
    summary = {
        "eval/goal": last_eval["eval/goal"],
        "eval/reward": last_eval["eval/reward"],
        **{k: v for k, v in last_eval.items() if k.startswith("eval/") and k not in ("eval/goal", "eval/reward")},
        "steps": tc.steps,
        "sampled_tokens": sampled_tokens,
        "wall_seconds": wall,
        "price": price.to_dict(),
        "sampled_tokens_vs_price": sampled_tokens / price.sampled_tokens_per_run,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _goal_rate(task: Task, batch, responses: list[str], G: int) -> float:
    hits = 0
    for b, resp in enumerate(responses):
        ex = batch[b // G]
        hits += bool(task.goal(ex.prompt, resp, ex.answer))
    return hits / len(responses)


def save_checkpoint(path: Path, model: TinyTransformer, tok: CharTokenizer) -> None:
    model.save_pretrained(path)
    tok.save(path / "tokenizer.json")


def load_run(run_dir: Path) -> tuple[config_mod.Config, TinyTransformer, CharTokenizer]:
    """Reload a finished run: its resolved config, checkpoint and tokenizer."""
    run_dir = Path(run_dir)
    ckpt = run_dir / "checkpoint"
    for need in (run_dir / "config.toml", ckpt / "model.safetensors", ckpt / "tokenizer.json"):
        if not need.is_file():
            raise RunError(f"{run_dir} is not a finished run: {need} is missing")
    cfg = config_mod.load(run_dir / "config.toml")
    return cfg, TinyTransformer.from_pretrained(ckpt), CharTokenizer.load(ckpt / "tokenizer.json")


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use the `rlvr train` command")
