"""The GRPO loop, top to bottom. The only module that wires the others together.

One step is two stages (rlvr.rollout, rlvr.learn) and a record:
  1. Sample P training prompts; sample G responses each from π_old (the current weights, no grad).
  2. Score every response with the task's reward (a deterministic program); failures are counted.
  3. Turn the (P, G) reward matrix into Δ with the configured scheme (rlvr.advantages).
  4. Store logp_old: the per-token log-probs the sampler computed under the distribution it
     actually sampled from (temperature, top-p). Detached; no second model copy is kept.
  5. With the KL term on, compute logp_ref under the frozen reference policy.
     -- steps 1-5 are `rollout(...) -> Batch`, which also records the policy version that sampled --
  6. μ passes over the same rollouts, each split into minibatches of whole groups (a prompt's
     rows stay together; with `model.share_prompt_forward` a Hugging Face model runs each prompt
     once and its G responses attend to the shared keys and values): recompute logp, form the ratio
     against logp_old, clip, add β·KL, backprop, clip the gradient norm, AdamW step.
     -- step 6 is `learn(learner, batch) -> stats` --
  7. π_old becomes the new weights (the next step samples from them; the version goes up by one);
     π_ref is refreshed every `algorithm.ref_refresh_every` steps (0 = never).
Held-out evaluation of the real goal runs every `eval.every` steps and at the end; the run
directory (rlvr.rundir) receives metrics, rollouts, warnings, state and checkpoints.

Departures from the GRPO paper, each a config field:
  1. The loss is reduced with `algorithm.agg` (default `token_mean`, as DAPO), not the paper's
     per-sequence mean; see rlvr.losses.AGGREGATIONS.
  2. logp_old is the sampler's own log-prob (same model code, same distribution) rather than a
     fresh forward pass; the two agree to float rounding, which a test checks.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlvr import advantages, config as config_mod, costs
from rlvr.diagnostics import Watch, length_by_outcome, pass_rate_histogram
from rlvr.distributed import Distributed, open_distributed
from rlvr.evaluate import evaluate
from rlvr.learn import Learner, learn, make_optimizer, make_scheduler
from rlvr.policy import Policy
from rlvr.reward_pool import RewardPool, open_pool
from rlvr.rollout import Batch, rollout
from rlvr.run import RunError, Setup, build, price_of  # noqa: F401  (RunError: raised to the CLI)
from rlvr.rundir import RunDir
from rlvr.state import load_state, save_state


@dataclass
class RunState:
    """Everything that changes during a run; saved whole by `save`, restored by `restore`."""

    setup: Setup
    learner: Learner
    reference: Policy | None
    """A frozen copy for the KL term; None without KL or under LoRA (the adapter-off policy is π_ref)."""
    prompt_rng: random.Random
    """Draws each step's training prompts."""
    sample_gen: torch.Generator
    """Sampling draws (on the model's device); the learner has its own generator."""
    step: int = 0
    version: int = 0
    """Policy version: the number of learn stages applied; each batch records the version that sampled it."""
    cost: dict = field(default_factory=lambda: {"sampled_tokens": 0, "forward_tokens": 0, "trained_tokens": 0,
                                                "flops": 0.0})
    wall_before: float = 0.0
    """Training seconds of earlier sessions of this run (resume)."""
    best: dict = field(default_factory=dict)
    watch: Watch = field(default_factory=Watch)
    last_eval: dict = field(default_factory=dict)
    price: costs.Price | None = None
    pool: RewardPool | None = None
    """Supervised reward workers (task.reward_workers); None scores in this process."""
    dist: Distributed | None = None
    """Rollout workers / learner group ([distributed]); None = both stages in this process."""

    @property
    def policy(self) -> Policy:
        return self.learner.policy

    def draw(self) -> list:
        """P training prompts, drawn without replacement within the step."""
        train, P = self.setup.task.train, self.setup.cfg.train.prompts_per_step
        return [train[i] for i in self.prompt_rng.sample(range(len(train)), P)]


def new_state(setup: Setup) -> RunState:
    """Optimizer, schedule, reference and generators of a fresh run (seeded by `train.seed`)."""
    cfg, model = setup.cfg, setup.model
    tc, ac = cfg.train, cfg.algorithm
    prompt_rng = random.Random(tc.seed)
    sample_gen = torch.Generator(device=setup.device).manual_seed(tc.seed)
    learn_gen = torch.Generator(device=setup.device).manual_seed(tc.seed + 1)
    torch.manual_seed(tc.seed)
    # π_ref: a frozen copy, or (LoRA) the same model with its adapter disabled, so no copy is held
    reference = None
    if ac.kl_coef > 0 and not model.has_adapter:
        reference = copy.deepcopy(model).requires_grad_(False).eval()
    opt = make_optimizer(model.trainable_params(), tc)
    learner = Learner(model, opt, make_scheduler(opt, tc), cfg, learn_gen, setup.limits.max_new_tokens)
    return RunState(setup, learner, reference, prompt_rng, sample_gen)


def save(state: RunState, run_dir: RunDir, wall: float) -> None:
    lr = state.learner
    save_state(run_dir.path, step=state.step, model=lr.policy, opt=lr.opt, sched=lr.sched, ref=state.reference,
               rng=state.prompt_rng, gen=state.sample_gen, learn_gen=lr.generator, cost=state.cost, wall=wall,
               extra={"version": state.version, "watch": dataclasses.asdict(state.watch)})


def restore(state: RunState, run_dir: RunDir) -> None:
    lr = state.learner
    got = load_state(run_dir.path, model=lr.policy, opt=lr.opt, sched=lr.sched, ref=state.reference,
                     rng=state.prompt_rng, gen=state.sample_gen, learn_gen=lr.generator)
    state.step, state.cost, state.wall_before = got["step"], got["cost"], got["wall"]
    state.version = got["extra"].get("version", state.step)
    if "watch" in got["extra"]:
        state.watch = Watch(**got["extra"]["watch"])
    state.best = run_dir.load_best()


def step_row(step: int, batch: Batch, stats: dict, state: RunState, t0: float) -> dict:
    """The metrics.jsonl row of one step: what the batch held, what the update did, what it cost."""
    groups, mask, logp_old = batch.groups, batch.rollout.mask, batch.logp_old
    lengths = batch.rollout.response_lengths.cpu()
    row = {
        "step": step,
        "train/reward": float(groups.rewards.mean()),
        "train/goal": float(groups.hits.float().mean()),
        "train/nonzero_delta_frac": advantages.nonzero_fraction(batch.delta),
        # of the groups first sampled this step (before dynamic sampling dropped any)
        "train/agreeing_groups_frac": float(advantages.agreeing_groups(batch.parts[0].rewards).float().mean()),
        "train/groups": len(groups.examples),
        "train/sampling_rounds": len(batch.parts),
        "train/pass_rate_hist": pass_rate_histogram(groups.hits),
        "train/response_len": float(lengths.float().mean()),
        **{f"train/response_len_{k}": v for k, v in
           length_by_outcome(lengths, groups.hits.view(-1), batch.rollout.truncated.cpu()).items()},
        # -logp of the sampled tokens is an unbiased estimate of the per-token sampling entropy
        "train/entropy": float(-(logp_old * mask).sum() / mask.sum().clamp(min=1)),
        "train/truncated_frac": float(batch.rollout.truncated.float().mean()),
        "train/reward_failures": sum(p.failures for p in batch.parts),
        "train/lr": stats["lr"],
        "train/sampled_tokens": state.cost["sampled_tokens"],
        "train/policy_version": batch.version,
        "time/sample_s": batch.sample_s,
        "time/step_s": time.perf_counter() - t0,
        "train/first_step_ratio_mean": stats["first_step_ratio_mean"],
        **{f"train/{k}": v for k, v in stats.items()
           if k not in ("lr", "first_step_ratio_mean", "optimizer_steps", "trained_tokens", "flops")},
    }
    for name, vals in groups.per_reward.items():
        row[f"train/reward_{name}"] = sum(vals) / len(vals)
    return row


def record(run_dir: RunDir, state: RunState, step: int, batch: Batch, row: dict) -> None:
    """Write the step's row, its warnings and a few of its groups."""
    cfg = state.setup.cfg
    run_dir.metrics(row)
    if row["train/reward_failures"]:
        errors = [e for p in batch.parts for e in p.errors]
        statuses = {k: sum(p.status_counts.get(k, 0) for p in batch.parts) for k in batch.parts[0].status_counts}
        what = "reward or goal" if statuses.get("goal_error") else "reward"
        run_dir.warn(step, f"{row['train/reward_failures']} {what} calls failed (scored 0, see train/reward_failures): "
                     f"{ {k: v for k, v in statuses.items() if v} }" + (f"; first error: {errors[0]}" if errors else ""))
    for msg in state.watch.after_step(step, row):
        run_dir.warn(step, msg)
    run_dir.rollouts(step, batch.groups, batch.delta, cfg.log.rollouts_per_step)


def run_eval(run_dir: RunDir, state: RunState, step: int) -> dict:
    """Held-out evaluation; keeps RUN_DIR/best when the goal beats the best so far."""
    setup = state.setup
    cfg = setup.cfg
    res = evaluate(state.policy, setup.tokenizer, setup.task, reward_weights=setup.reward_weights,
                   limits=setup.limits, prompts=cfg.eval.prompts, batch_size=cfg.eval.batch_size,
                   pass_k=cfg.eval.pass_k, pass_k_prompts=cfg.eval.pass_k_prompts,
                   temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, seed=cfg.train.seed,
                   pool=state.pool)
    row = {"step": step, **{f"eval/{k}": v for k, v in res.items()}}
    run_dir.metrics(row)
    for msg in state.watch.after_eval(step, row["eval/goal"]):
        run_dir.warn(step, msg)
    if cfg.eval.keep_best and row["eval/goal"] > state.best.get("eval/goal", -1.0):
        state.best = {"step": step, "eval/goal": row["eval/goal"], "eval/reward": row["eval/reward"]}
        run_dir.save_best(state.policy, setup.tokenizer, cfg, state.best)
    state.last_eval = row
    return row


def progress(state: RunState, row: dict, elapsed: float) -> str:
    step, steps = row["step"], state.setup.cfg.train.steps
    ev = f" | eval/goal {state.last_eval['eval/goal']:.3f}" if state.last_eval else ""
    done = int(20 * step / steps)
    return (f"[{'#' * done}{'.' * (20 - done)}] step {step:>5}/{steps} | reward {row['train/reward']:.3f} "
            f"| goal {row['train/goal']:.3f} | nonzero Δ {row['train/nonzero_delta_frac']:.2f} "
            f"| agree {row['train/agreeing_groups_frac']:.2f} | H {row['train/entropy']:.2f}{ev} | {elapsed:.1f}s")


def start(cfg: config_mod.Config, run_dir: RunDir, *, overwrite: bool, resume: bool, log) -> RunState:
    """Check, build, price and write the start of the run (or restore it with --resume)."""
    if resume:
        if overwrite:
            raise RunError("--resume and --overwrite contradict each other; choose one")
        run_dir.check_resumable(cfg)
    setup = build(cfg)
    price = price_of(setup)
    if not resume:
        run_dir.prepare(overwrite=overwrite)
    run_dir.write_start(cfg, price)
    for line in price.lines():
        log(line)
    state = new_state(setup)
    state.price = price
    if resume:
        restore(state, run_dir)
        log(f"resumed {run_dir.path} after step {state.step}")
    run_dir.open_logs(resume_after=state.step if resume else None)
    return state


def train(cfg: config_mod.Config, out: Path, *, overwrite: bool = False, resume: bool = False, log=print) -> dict:
    """Run the loop; write config.toml, price.json, metrics.jsonl, rollouts.jsonl, state/, checkpoint/, summary.json.

    `resume=True` continues a run from its last saved state (`state/`, written at every evaluation,
    every `train.save_every` steps and at the end) with the same weights, optimizer, scheduler,
    RNG streams and cost counters, so an interrupted run continues as if it had not stopped.
    """
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    run_dir = RunDir(out, log=log)
    state = start(cfg, run_dir, overwrite=overwrite, resume=resume, log=log)
    with open_pool(cfg.task, state.setup.task) as state.pool, \
            open_distributed(cfg, state.setup, state.learner, state.version, state.step, log) as state.dist:
        return loop(run_dir, state, log)


def loop(run_dir: RunDir, state: RunState, log) -> dict:
    """Steps from the one after `state.step` to `train.steps`, then `finish`."""
    cfg = state.setup.cfg
    tc, ec = cfg.train, cfg.eval
    t_start = time.perf_counter()
    for step in range(state.step + 1, tc.steps + 1):
        t0 = time.perf_counter()
        batch = (state.dist.rollout if state.dist else rollout)(                     # 1.-5.
            state.setup, state.policy, state.reference, state.draw, version=state.version,
            generator=state.sample_gen, pool=state.pool)
        stats = (state.dist.learn if state.dist else learn)(state.learner, batch)    # 6. (+ weight sync)
        state.version += 1                                                           # 7. π_old <- π
        if state.reference is not None and cfg.algorithm.ref_refresh_every and step % cfg.algorithm.ref_refresh_every == 0:
            state.reference.load_state_dict(state.policy.state_dict())
        state.step = step
        for k in ("sampled_tokens", "forward_tokens", "flops"):
            state.cost[k] += batch.cost[k]
        state.cost["trained_tokens"] += stats["trained_tokens"]
        state.cost["flops"] += stats["flops"]
        row = step_row(step, batch, stats, state, t0)
        record(run_dir, state, step, batch, row)
        if ec.every and step % ec.every == 0 and step != tc.steps:
            run_eval(run_dir, state, step)
        if step != tc.steps and ((tc.save_every and step % tc.save_every == 0)
                                 or (not tc.save_every and ec.every and step % ec.every == 0)):
            save(state, run_dir, state.wall_before + time.perf_counter() - t_start)
        if step % max(1, cfg.log.print_every) == 0 or step == 1:
            log(progress(state, row, time.perf_counter() - t_start))
    return finish(run_dir, state, state.wall_before + time.perf_counter() - t_start, log)


def finish(run_dir: RunDir, state: RunState, wall: float, log) -> dict:
    """Final state, evaluation, checkpoint and summary."""
    steps, cost, price = state.setup.cfg.train.steps, state.cost, state.price
    save(state, run_dir, wall)
    last = run_eval(run_dir, state, steps)
    log(f"final eval: goal {last['eval/goal']:.4f} reward {last['eval/reward']:.4f} "
        f"on {last['eval/prompts']} held-out prompts")
    best = state.best
    summary = {
        "eval/goal": last["eval/goal"],
        "eval/reward": last["eval/reward"],
        **{k: v for k, v in last.items() if k.startswith("eval/") and k not in ("eval/goal", "eval/reward")},
        "steps": steps,
        "sampled_tokens": cost["sampled_tokens"],
        "wall_seconds": wall,
        **{f"cost/{k}": v for k, v in cost.items()},
        "cost/wall_seconds": wall,
        **({"best/step": best["step"], "best/eval_goal": best["eval/goal"]} if best else {}),
        "price": price.to_dict(),
        "sampled_tokens_vs_price": cost["sampled_tokens"] / price.sampled_tokens_per_run,
    }
    run_dir.finish(state.policy, state.setup.tokenizer, summary, steps)
    log(f"cost: sampled {cost['sampled_tokens']:,} tokens (price {price.sampled_tokens_per_run:,}), "
        f"forward {cost['forward_tokens']:,} (price {price.forward_tokens_per_run:,}), "
        f"trained {cost['trained_tokens']:,} (price {price.trained_tokens_per_run:,}), "
        f"{cost['flops']:.3g} FLOP (price {price.flops_per_run:.3g}), {wall:.1f} s")
    return summary


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use the `rlvr train` command")
