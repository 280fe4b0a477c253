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

Nothing is lost when a run stops early:
  * state is saved at each evaluation (or every `train.save_every` steps) and every
    `train.save_every_minutes` of wall clock, each save crash-safe (rlvr.state);
  * SIGINT (Ctrl-C) or SIGTERM lets the current step finish, saves state, writes summary.json marked
    `"interrupted": true` and exits 130 / 143 ("continue with --resume"); a second Ctrl-C exits at once;
  * an update whose loss or gradient norm is not finite is skipped (`train/skipped_updates`, warned);
    `STOP_AFTER_SKIPPED_STEPS` steps in a row with every update skipped, or weights that are no longer
    finite, stop the run with the last saved state kept.

Departures from the GRPO paper, each a config field:
  1. The loss is reduced with `algorithm.agg` (default `token_mean`, as DAPO), not the paper's
     per-sequence mean; see rlvr.losses.AGGREGATIONS.
  2. In fp32, logp_old is the sampler's own log-prob (same model code, same distribution) rather
     than a fresh forward pass; the two agree to float rounding, which a test checks. Under bf16
     (`model.autocast`, `model.dtype`) they differ by more, so `algorithm.logp_old = "auto"` (the
     default) then takes logp_old from the learner's own forward (as `recompute` does always; with
     one minibatch its first forward, detached, as TRL does when it updates once) and weighs Δ by
     min(π_train / π_sampler, algorithm.is_cap).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlvr import config as config_mod, costs, machine as machine_mod
from rlvr.build import build
from rlvr.diagnostics import Watch, exploration_levers
from rlvr.distributed import Distributed, open_distributed
from rlvr.evaluate import evaluate
from rlvr.hostmem import set_host_memory
from rlvr.procmem import ResidentPeak
from rlvr.learn import Learner, learn, make_optimizer, make_scheduler
from rlvr.machine import set_threads
from rlvr.policy import Policy
from rlvr.run_price import check_device_memory, check_memory, price_of
from rlvr.reward_pool import RewardPool, open_pool
from rlvr.rollout import Batch, rollout
from rlvr.rundir import LogWriteError, RunDir, schedule_change_note, snapshot_count
from rlvr.setup_types import RunError, Setup
from rlvr.state import StateError, load_state, save_state
from rlvr.step_record import record, step_row
from rlvr.value import LearnedBaseline


STOP_AFTER_SKIPPED_STEPS = 3
"""Consecutive steps with every update skipped (non-finite loss or gradient norm) that stop the run."""


class StartupInterrupted(KeyboardInterrupt):
    """SIGINT / SIGTERM while the run starts (task, model, price, the step-0 evaluation): raised at once
    in the main thread, so the run stops where it is; nothing was trained, nothing new is saved."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Interrupts:
    """SIGINT / SIGTERM during a run: while `starting` (`train` sets it until the first step begins) it
    stops the run at once (StartupInterrupted); otherwise the first asks the loop to stop after the current step (state
    saved, summary marked interrupted, exit 128 + the signal's number); a second one exits at once,
    keeping the last saved state. Installed only in the main thread (signals go nowhere else)."""

    def __init__(self, *, starting: bool = False):
        self.signum: int | None = None
        self.starting = starting
        self._old: dict = {}

    def __enter__(self) -> "Interrupts":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self.starting:
            self.signum = signum
            os.write(2, f"\nrlvr: {name} during start-up: stopping now\n".encode())
            raise StartupInterrupted(signum)
        if self.signum is not None:  # os.write, not print: a handler may run in the middle of a print
            os.write(2, f"\nrlvr: {name} again: exiting now; the last saved state is kept (continue with "
                        f"--resume)\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        os.write(2, f"\nrlvr: {name}: stopping after the current step and saving state "
                    f"(Ctrl-C again to exit at once)\n".encode())


COST_ZERO = {"sampled_tokens": 0, "forward_tokens": 0, "trained_tokens": 0, "flops": 0.0,
             "step_seconds": 0.0, "score_seconds": 0.0, "eval_seconds": 0.0}
"""A run's counted cost before its first step. ``step_seconds``: the steps' own seconds (rollout,
rewards, learn: each metrics.jsonl row's ``time/step_s``); ``score_seconds``: the part of them this
process spent scoring responses (``time/score_s``: the rewards and the goal, which the price leaves
out); the steps less that are the figure the price's expected wall time is set against
(``steps_vs_expected``); ``eval_seconds``: the held-out evaluations inside the run's wall time (the step-0 one
and every ``eval.every``, best checkpoint included; the final one comes after the wall time is
taken). The rest of the wall time is saving state, snapshots and logging."""


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
    cost: dict = field(default_factory=lambda: dict(COST_ZERO))
    wall_before: float = 0.0
    """Training seconds of earlier sessions of this run (resume)."""
    best: dict = field(default_factory=dict)
    watch: Watch = field(default_factory=Watch)
    last_eval: dict = field(default_factory=dict)
    price: costs.Price | None = None
    eval0: dict = field(default_factory=dict)
    """The step-0 evaluation (eval.at_start), for the summary."""
    pool: RewardPool | None = None
    """Supervised reward workers (task.reward_workers); None scores in this process."""
    value: LearnedBaseline | None = None
    """The learned baseline's critic and its optimiser (algorithm.scheme = learned); saved with the run."""
    saved_step: int | None = None
    """The step of the state last saved (None before the first save of this session)."""
    last_save: float = field(default_factory=time.monotonic)
    """When state was last saved (train.save_every_minutes counts from here)."""
    skipped_run: int = 0
    """Consecutive steps, up to this one, whose every update was skipped."""
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
    flops = costs.model_flops_per_token(model, setup.limits.prompt_tokens, setup.limits.max_new_tokens)
    learner = Learner(model, opt, make_scheduler(opt, tc), cfg, learn_gen, setup.limits.max_new_tokens, flops,
                      autocast=setup.numerics.context)
    value = (LearnedBaseline(setup.tokenizer.vocab_size, lr=ac.value_lr, seed=tc.seed, device=setup.device)
             if ac.scheme == "learned" else None)
    levers = exploration_levers(cfg.algorithm.entropy_coef, cfg.train.samples_per_prompt, cfg.sampling.temperature)
    return RunState(setup, learner, reference, prompt_rng, sample_gen, value=value, watch=Watch(levers=levers))


def save(state: RunState, run_dir: RunDir, wall: float) -> None:
    """Save the state after `state.step` (rlvr.state), the logs fsynced first: the state refers to their rows."""
    run_dir.sync_logs()
    lr = state.learner
    value_t, value_meta = state.value.to_tensors() if state.value is not None else ({}, None)
    save_state(run_dir.path, step=state.step, model=lr.policy, opt=lr.opt, sched=lr.sched, ref=state.reference,
               rng=state.prompt_rng, gen=state.sample_gen, learn_gen=lr.generator, cost=state.cost, wall=wall,
               extra={"version": state.version, "watch": dataclasses.asdict(state.watch), "value": value_meta},
               extra_tensors={f"value.{k}": v for k, v in value_t.items()})
    state.saved_step, state.last_save = state.step, time.monotonic()


def restore(state: RunState, run_dir: RunDir) -> None:
    lr = state.learner
    got = load_state(run_dir.path, model=lr.policy, opt=lr.opt, sched=lr.sched, ref=state.reference,
                     rng=state.prompt_rng, gen=state.sample_gen, learn_gen=lr.generator)
    state.step, state.cost, state.wall_before = got["step"], {**COST_ZERO, **got["cost"]}, got["wall"]
    state.saved_step = state.step
    state.version = got["extra"].get("version", state.step)
    if "watch" in got["extra"]:   # its history from the state, what the run does now from the configuration
        state.watch = Watch(**{**got["extra"]["watch"], "levers": state.watch.levers})
    if state.value is not None:
        try:
            state.value.load_tensors({k[6:]: v for k, v in got["extra_tensors"].items() if k.startswith("value.")},
                                     got["extra"]["value"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise StateError(f"{got['dir']}: no usable learned-baseline state ({type(e).__name__}: {e})") from None
    state.best = run_dir.load_best()


def run_eval(run_dir: RunDir, state: RunState, step: int) -> dict:
    """Held-out evaluation; keeps RUN_DIR/best when the goal beats the best so far."""
    setup = state.setup
    cfg = setup.cfg
    res = evaluate(state.policy, setup.tokenizer, setup.task, reward_weights=setup.reward_weights,
                   limits=setup.limits, prompts=cfg.eval.prompts, batch_size=cfg.eval.batch_size,
                   pass_k=cfg.eval.pass_k, pass_k_prompts=cfg.eval.pass_k_prompts,
                   temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
                   min_p=cfg.sampling.min_p, seed=cfg.train.seed, pool=state.pool, autocast=setup.numerics.context,
                   group_by=cfg.eval.group_by)
    row = {"step": step, **{f"eval/{k}": v for k, v in res.items()}}
    run_dir.metrics(row)
    for msg in state.watch.after_eval(step, row["eval/goal"]):
        run_dir.warn(step, msg)
    if cfg.eval.keep_best and row["eval/goal"] > state.best.get("eval/goal", -1.0):
        state.best = {"step": step, "eval/goal": row["eval/goal"], "eval/reward": row["eval/reward"]}
        run_dir.save_best(state.policy, setup.tokenizer, cfg, state.best)
    state.last_eval = row
    return row


def timed_eval(run_dir: RunDir, state: RunState, step: int) -> dict:
    """``run_eval``, its seconds counted in ``state.cost["eval_seconds"]`` (an evaluation inside the
    run's wall time)."""
    t = time.perf_counter()
    row = run_eval(run_dir, state, step)
    state.cost["eval_seconds"] += time.perf_counter() - t
    return row


def progress(state: RunState, row: dict, elapsed: float, steps_done: int, before_s: float = 0.0) -> str:
    """The progress line: bar, step, the figures that show learning, seconds since this session
    began, seconds per step and an ETA (steps left at this session's mean step time, evaluations
    every eval.every included; not the ``before_s`` seconds spent before the first step, the step-0
    evaluation, which no later step repeats)."""
    step, steps = row["step"], state.setup.cfg.train.steps
    ev = f" | eval/goal {state.last_eval['eval/goal']:.3f}" if state.last_eval else ""
    done = int(20 * step / steps)
    per_step = max(0.0, elapsed - before_s) / max(1, steps_done)
    return (f"[{'#' * done}{'.' * (20 - done)}] step {step:>5}/{steps} | reward {row['train/reward']:.3f} "
            f"| goal {row['train/goal']:.3f} | nonzero Δ {row['train/nonzero_delta_frac']:.2f} "
            f"| agree {row['train/agreeing_groups_frac']:.2f} | H {row['train/entropy']:.2f}{ev} | {elapsed:.1f}s "
            f"| {per_step:.2f} s/step | ETA {_duration(per_step * (steps - step))}")


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def start(cfg: config_mod.Config, run_dir: RunDir, *, overwrite: bool, resume: bool, log) -> RunState:
    """Check, build, price and write the start of the run (or restore it with --resume)."""
    if resume:
        if overwrite:
            raise RunError("--resume and --overwrite contradict each other; choose one")
        saved = run_dir.check_resumable(cfg)
    run_dir.check_writable()
    setup = build(cfg, autocast=run_dir.recorded_autocast() if resume and cfg.model.autocast == "auto" else None,
                  time_bf16=not resume)
    price = price_of(setup, probe_learn=True)
    run_dir.check_space(price, snapshot_count(cfg.train))
    check_memory(cfg, price)  # refuses a run that would not fit the machine's memory (rlvr.run_price)
    check_device_memory(cfg, price, setup.device)  # on a GPU: the copies the first update allocates
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
        note = schedule_change_note(saved, cfg, state.step)
        if note:
            log(note)
    run_dir.open_logs(cfg, resume_after=state.step if resume else None)
    return state


def train(cfg: config_mod.Config, out: Path, *, overwrite: bool = False, resume: bool = False, log=print) -> dict:
    """Run the loop; write config.toml, price.json, metrics.jsonl, rollouts.jsonl, state/, checkpoint/, summary.json.

    `resume=True` continues a run from its last saved state (`state/`, written at every evaluation,
    every `train.save_every` steps, every `train.save_every_minutes`, on SIGINT / SIGTERM and at the
    end) with the same weights, optimizer, scheduler, RNG streams and cost counters, so an
    interrupted run continues as if it had not stopped. A run stopped by a signal returns its summary
    with `"interrupted": True` and `"exit_code"` (130 for SIGINT, 143 for SIGTERM).
    """
    _, busy = set_threads(cfg)  # train.threads (0 = this process's cores) and the oversubscription warning
    # before the model's first allocation (rlvr.hostmem)
    host_memory = set_host_memory(cfg.train.host_memory, cfg.model.gradient_checkpointing)
    run_dir = RunDir(out, log=log)
    state = None
    with Interrupts(starting=True) as stop:
        try:
            state = start(cfg, run_dir, overwrite=overwrite, resume=resume, log=log)
            log(host_memory)
            if busy:
                run_dir.warn(state.step, busy)
            with open_pool(cfg.task, state.setup.task) as state.pool, \
                    open_distributed(cfg, state.setup, state.learner, state.version, state.step, log,
                                     builder=build) as state.dist:
                t0 = time.perf_counter()
                try:
                    return loop(run_dir, state, log, stop)
                except LogWriteError as e:
                    raise RunError(write_failed(run_dir, state, state.wall_before + time.perf_counter() - t0,
                                                str(e))) from None
        except StartupInterrupted as e:
            return startup_interrupted(run_dir, state, e.signum, log)
        finally:
            run_dir.close()


def write_failed(run_dir: RunDir, state: RunState, wall: float, why: str) -> str:
    """The message of a run stopped because its log could not be written (a full disk): the state after
    `state.step` is saved when it fits (a resume continues from there), else the last saved one is kept."""
    if state.saved_step == state.step:
        saved = f"the state after step {state.step} is saved"
    else:
        try:
            save(state, run_dir, wall)
            saved = f"the state after step {state.step} was saved"
        except (StateError, LogWriteError) as e:
            saved = f"the state after step {state.step} did not fit ({e}); {kept(state)}"
    return (f"stopped at step {state.step}: {why}; {saved}. Free space on that disk, then continue with "
            f"--resume (rlvr train CONFIG --out {run_dir.path} --resume)")


def startup_interrupted(run_dir: RunDir, state: RunState | None, signum: int, log) -> dict:
    """The summary of a run stopped by a signal before its first step: nothing trained, nothing saved."""
    steps = state.step if state is not None else 0
    log(f"interrupted during start-up, before step {steps + 1}; nothing new was trained or saved"
        + (f" (the saved state after step {steps} is kept)" if steps else ""))
    return {"interrupted": True, "signal": signal.Signals(signum).name, "exit_code": 128 + signum, "steps": steps}


def advance(state: RunState, step: int) -> tuple[Batch, dict]:
    """One step: rollout, learn, π_old <- π, reference refresh, cost counters."""
    cfg = state.setup.cfg
    try:
        batch = (state.dist.rollout if state.dist else rollout)(                     # 1.-5.
            state.setup, state.policy, state.reference, state.draw, version=state.version,
            generator=state.sample_gen, pool=state.pool, value=state.value)
    except RuntimeError as e:
        if "inf" not in str(e) and "nan" not in str(e):
            raise
        raise RunError(f"step {step}: sampling failed ({' '.join(str(e).split())[:200]}): the weights have "
                       f"diverged; {kept(state)}; lower train.lr or algorithm.kl_coef") from None
    stats = (state.dist.learn if state.dist else learn)(state.learner, batch)        # 6. (+ weight sync)
    state.version += 1                                                               # 7. π_old <- π
    if state.reference is not None and cfg.algorithm.ref_refresh_every and step % cfg.algorithm.ref_refresh_every == 0:
        refresh_reference(state.reference, state.policy, cfg.algorithm.ref_mixup_alpha)
    state.step = step
    for k in ("sampled_tokens", "forward_tokens", "flops"):
        state.cost[k] += batch.cost[k]
    state.cost["trained_tokens"] += stats["trained_tokens"]
    state.cost["forward_tokens"] += stats["logp_old_forward_tokens"]   # rlvr.learn.prepass_logp_old
    state.cost["flops"] += stats["flops"]
    return batch, stats


@torch.no_grad()
def refresh_reference(reference, policy, alpha: float) -> None:
    """π_ref <- π_ref + α (π - π_ref) on every parameter (algorithm.ref_mixup_alpha; ``torch.lerp``, so a
    weight both hold alike stays exactly as it is), buffers copied; α = 1 loads the policy's state.
    A weight tied to another (input and output embeddings) is moved once."""
    if alpha == 1.0:
        reference.load_state_dict(policy.state_dict())
        return
    mine = dict(policy.named_parameters())
    for name, r in reference.named_parameters():       # each tensor once, under its first name
        r.lerp_(mine[name].to(r.dtype), alpha)
    theirs = dict(policy.named_buffers())
    for name, b in reference.named_buffers():
        b.copy_(theirs[name])


def kept(state: RunState) -> str:
    """Where the last good state is, for the messages that stop a run."""
    if state.saved_step is None:
        return "no state was saved yet"
    return f"the last saved state (step {state.saved_step}) is kept"


def check_updates(run_dir: RunDir, state: RunState, step: int, stats: dict) -> None:
    """Warn about skipped updates; stop (RunError) after STOP_AFTER_SKIPPED_STEPS steps in a row with
    every update skipped, or when an applied update left a weight that is not finite."""
    cfg = state.setup.cfg
    fix = f"lower train.lr (now {cfg.train.lr:g}) or algorithm.kl_coef (now {cfg.algorithm.kl_coef:g})"
    if stats.get("skipped_updates"):
        run_dir.warn(step, f"{stats['skipped_updates']} of {stats['optimizer_steps']} updates skipped: the loss "
                           f"or the gradient norm was not finite (train/skipped_updates)")
    every = stats.get("skipped_updates", 0) >= stats["optimizer_steps"]
    state.skipped_run = state.skipped_run + 1 if every else 0
    if state.skipped_run >= STOP_AFTER_SKIPPED_STEPS:
        raise RunError(f"stopped at step {step}: every update of the last {state.skipped_run} steps was skipped "
                       f"(non-finite loss or gradient norm, see train/skipped_updates in "
                       f"{run_dir.path / 'metrics.jsonl'}); {kept(state)}; {fix}")
    if not every and not all(bool(torch.isfinite(p).all()) for p in state.policy.trainable_params()):
        raise RunError(f"stopped at step {step}: the update left weights that are not finite (inf or nan); "
                       f"{kept(state)}; {fix}")


def due_save(state: RunState, step: int) -> bool:
    """Save state after `step`? Every train.save_every steps (or each evaluation when 0), and when
    train.save_every_minutes have passed since the last save. The final step saves in `finish`."""
    tc, ec = state.setup.cfg.train, state.setup.cfg.eval
    if step == tc.steps:
        return False
    by_step = (tc.save_every and step % tc.save_every == 0) or (not tc.save_every and ec.every and step % ec.every == 0)
    by_clock = tc.save_every_minutes and time.monotonic() - state.last_save >= 60 * tc.save_every_minutes
    return bool(by_step or by_clock)


def loop(run_dir: RunDir, state: RunState, log, stop: Interrupts | None = None) -> dict:
    """Steps from the one after `state.step` to `train.steps`, then `finish` (or `interrupted`)."""
    cfg = state.setup.cfg
    tc, ec = cfg.train, cfg.eval
    t_start = time.perf_counter()
    if state.step == 0 and ec.at_start:  # where the run starts, before any update
        row = timed_eval(run_dir, state, 0)
        log(f"step 0 eval: goal {row['eval/goal']:.3f} reward {row['eval/reward']:.3f} "
            f"on {row['eval/prompts']} held-out prompts")
        state.eval0 = row
    state.last_save = time.monotonic()
    if stop is not None:
        stop.starting = False                     # from here a signal stops the run after its step
    before_s = time.perf_counter() - t_start      # the step-0 evaluation: not a part of any step
    first = state.step + 1
    for step in range(first, tc.steps + 1):
        if stop is not None and stop.signum is not None:  # SIGINT / SIGTERM came during the last step
            return interrupted(run_dir, state, state.wall_before + time.perf_counter() - t_start, log, stop.signum)
        t0 = time.perf_counter()
        with ResidentPeak() as resident:          # the step's peak, for memory/step_peak_mib
            batch, stats = advance(state, step)
        row = step_row(step, batch, stats, state.cost["sampled_tokens"], t0)
        row["memory/step_peak_mib"] = resident.peak / 2**20
        state.cost["step_seconds"] += row["time/step_s"]
        state.cost["score_seconds"] += row["time/score_s"]
        record(run_dir, state.watch, step, batch, row, cfg.log.rollouts_per_step)
        check_updates(run_dir, state, step, stats)
        if ec.every and step % ec.every == 0 and step != tc.steps:
            timed_eval(run_dir, state, step)
        if tc.snapshot_every and step % tc.snapshot_every == 0:
            run_dir.save_snapshot(state.policy, state.setup.tokenizer, cfg, step)
        if due_save(state, step):
            save(state, run_dir, state.wall_before + time.perf_counter() - t_start)
        if step % max(1, cfg.log.print_every) == 0 or step == 1:
            log(progress(state, row, time.perf_counter() - t_start, step - first + 1, before_s))
    return finish(run_dir, state, state.wall_before + time.perf_counter() - t_start, log)


def interrupted(run_dir: RunDir, state: RunState, wall: float, log, signum: int) -> dict:
    """Stop after `state.step` on a signal: save state (unless just saved), write summary.json marked
    interrupted, say how to continue."""
    if state.saved_step != state.step:
        save(state, run_dir, wall)
    cost = state.cost
    summary = {
        "interrupted": True,
        "signal": signal.Signals(signum).name,
        "exit_code": 128 + signum,
        "steps": state.step,
        "steps_planned": state.setup.cfg.train.steps,
        **{k: v for k, v in state.last_eval.items() if k != "step"},
        "sampled_tokens": cost["sampled_tokens"],
        "wall_seconds": wall,
        **{f"cost/{k}": v for k, v in cost.items()},
        "cost/wall_seconds": wall,
        "price": state.price.to_dict(),
    }
    run_dir.write_summary(summary)
    log(f"interrupted after step {state.step}; continue with --resume (rlvr train CONFIG --out {run_dir.path} --resume)")
    return summary


def wall_line(wall: float, cost: dict, price: costs.Price) -> str:
    """The cost line's seconds: the wall time against the price's lower bound, then its parts: the
    steps, the scoring of their responses, and the steps less that against the price's expected
    wall time (which prices the steps without their rewards: `steps_vs_expected`), the evaluations,
    and the rest (saving state, snapshots, logging)."""
    est = f" (estimate >= {price.wall_seconds_estimate:.1f} s)" if price.wall_seconds_estimate else ""
    steps_s, score_s, eval_s = cost["step_seconds"], cost["score_seconds"], cost["eval_seconds"]
    ratio = steps_vs_expected(cost, price)
    exp = (f"; the rest {steps_s - score_s:.1f} s against the expected ~{price.wall_seconds_expected:.1f} s: "
           f"{ratio:.2f}x" if ratio is not None else "")
    return (f"{wall:.1f} s{est}: steps {steps_s:.1f} s (scoring their responses {score_s:.1f} s{exp}), "
            f"evaluation {eval_s:.1f} s, saves and logging {max(0.0, wall - steps_s - eval_s):.1f} s")


def steps_vs_expected(cost: dict, price: costs.Price) -> float | None:
    """The steps' seconds less their scoring (the price's expected wall time leaves the rewards out)
    over that expected time; None where the price has none."""
    if not price.wall_seconds_expected:
        return None
    return (cost["step_seconds"] - cost["score_seconds"]) / price.wall_seconds_expected


RATE_RECHECK_S = 0.2
"""Seconds of matrix products `machine_speed` times at the end of a run."""


def machine_speed(state: RunState) -> float | None:
    """The machine's fp32 matmul rate at the end of the run over the rate the price measured at its
    start (rlvr.machine.matmul_rate, cached in this process at the run's threads): where it moved, so
    did every step's time, and the steps' ratio to the expected wall time with it. None where the
    price measured no rate in this process (a rate given to it, a resumed run's earlier session)."""
    device = state.setup.device
    then = machine_mod.cached_matmul_rate(device)
    return machine_mod.measure_matmul_rate(device, RATE_RECHECK_S) / then if then else None


def finish(run_dir: RunDir, state: RunState, wall: float, log) -> dict:
    """Final state, evaluation, checkpoint and summary."""
    steps, cost, price = state.setup.cfg.train.steps, state.cost, state.price
    speed = machine_speed(state)
    save(state, run_dir, wall)
    last = run_eval(run_dir, state, steps)
    log(f"final eval: goal {last['eval/goal']:.4f} reward {last['eval/reward']:.4f} "
        f"on {last['eval/prompts']} held-out prompts")
    best = state.best
    summary = {
        "eval/goal": last["eval/goal"],
        "eval/reward": last["eval/reward"],
        **{k: v for k, v in last.items() if k.startswith("eval/") and k not in ("eval/goal", "eval/reward")},
        **{f"eval0/{k[5:]}": v for k, v in state.eval0.items() if k.startswith("eval/")},
        "steps": steps,
        "sampled_tokens": cost["sampled_tokens"],
        "wall_seconds": wall,
        **{f"cost/{k}": v for k, v in cost.items()},
        "cost/wall_seconds": wall,
        **({"best/step": best["step"], "best/eval_goal": best["eval/goal"]} if best else {}),
        "price": price.to_dict(),
        "sampled_tokens_vs_price": cost["sampled_tokens"] / price.sampled_tokens_per_run,
        "cost/wall_vs_estimate": wall / price.wall_seconds_estimate if price.wall_seconds_estimate else None,
        "cost/steps_vs_expected": steps_vs_expected(cost, price),
        "machine/matmul_rate_vs_start": speed,
    }
    run_dir.finish(state.policy, state.setup.tokenizer, summary, steps)
    worst = f", worst case {price.sampled_tokens_per_run_worst:,}" if price.sampling_rounds > 1 else ""
    log(f"cost: sampled {cost['sampled_tokens']:,} tokens (price {price.sampled_tokens_per_run:,}{worst}), "
        f"forward {cost['forward_tokens']:,} (price {price.forward_tokens_per_run:,}), "
        f"trained {cost['trained_tokens']:,} (price {price.trained_tokens_per_run:,}), "
        f"{cost['flops']:.3g} FLOP (price {price.flops_per_run:.3g}), {wall_line(wall, cost, price)}"
        + (f"; this machine's matmul rate at the end: {speed:.2f}x the one measured at the start" if speed else ""))
    return summary


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use the `rlvr train` command")
