"""Kill runs with SIGKILL at random moments, resume them, and check nothing was lost.

    python benchmarks/kill_resume.py [--runs 5] [--kills 3] [--steps 12] [--seed 0]

First one uninterrupted run of a tiny sort configuration gives the reference final weights and
the seconds W its training took (from its first logged step to its exit). Then each of `--runs`
runs is started, and once it logs a step, SIGKILLed after a random delay in (0, W) (mid-step, in
the middle of a state or checkpoint save, in the final evaluation), restarted with `--resume`,
killed again, `--kills` times in all, and finally left to finish. A restart after a kill that came
before the first state was saved starts the run afresh (`--overwrite`): nothing to resume yet.

Printed: how many resumes succeeded (the resumed process continued instead of refusing or failing),
and whether every final checkpoint/model.safetensors is byte-identical to the uninterrupted run's.
State is saved after every step (`train.save_every = 1`) so that kills often land inside a save.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model.n_embd=32", "--model.n_layer=1", "--model.n_head=2", "--train.prompts_per_step=4",
        "--train.samples_per_prompt=4", "--task.options={n = 3, heldout = 50}", "--eval.prompts=20",
        "--eval.pass_k=0", "--eval.every=0", "--train.lr=0.01", "--train.lr_schedule=constant",
        "--train.threads=1", "--task.reward_workers=0", "--train.save_every=1"]


def command(out: Path, steps: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "rlvr.cli", "train", "examples/sort.toml", *TINY, f"--train.steps={steps}",
            "--out", str(out), *flags]


def start(out: Path, steps: int) -> tuple[subprocess.Popen, bool]:
    """Start the run, resuming when it has state to resume; (process, resumed?)."""
    resumable = (out / "config.toml").is_file() and any(p.name.startswith("state") for p in out.iterdir())
    flags = ["--resume"] if resumable else ["--overwrite"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(command(out, steps, *flags), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True), resumable


def rows(out: Path) -> int:
    """Lines in metrics.jsonl (grows as the run logs steps)."""
    try:
        return len((out / "metrics.jsonl").read_bytes().splitlines())
    except OSError:
        return 0


def wait_for_a_step(proc: subprocess.Popen, out: Path, before: int) -> float:
    """Seconds until the process logs a row past `before` lines of metrics.jsonl (or exits)."""
    t0 = time.perf_counter()
    while proc.poll() is None and rows(out) <= before:
        time.sleep(0.01)
    return time.perf_counter() - t0


def one_run(out: Path, steps: int, kills: int, window: float, rng: random.Random) -> dict:
    """Kill the run `kills` times at random moments, then let it finish; count what happened."""
    resumes = failed = 0
    for _ in range(kills):
        before = rows(out)
        proc, resumed = start(out, steps)
        resumes += resumed
        wait_for_a_step(proc, out, before)
        try:
            proc.wait(timeout=rng.uniform(0, window))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            continue
        if proc.returncode != 0:  # it stopped by itself: a resume that failed
            failed += resumed
            print(f"  {out.name}: exit {proc.returncode}: {proc.stderr.read().strip()[-300:]}", file=sys.stderr)
        else:
            break  # finished before the kill came
    proc, resumed = start(out, steps)
    resumes += resumed
    _, err = proc.communicate()
    if proc.returncode != 0:
        failed += resumed
        print(f"  {out.name}: final exit {proc.returncode}: {err.strip()[-300:]}", file=sys.stderr)
    ckpt = out / "checkpoint" / "model.safetensors"
    return {"resumes": resumes, "failed": failed, "weights": ckpt.read_bytes() if ckpt.is_file() else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--kills", type=int, default=3, help="SIGKILLs per run before it is left to finish")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=0, help="seeds the kill moments")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kill_resume-"))
    try:
        t0 = time.perf_counter()
        proc, _ = start(work / "straight", args.steps)
        wait_for_a_step(proc, work / "straight", 0)
        t1 = time.perf_counter()
        if proc.wait() != 0:
            raise SystemExit(f"the uninterrupted run failed: {proc.stderr.read()[-500:]}")
        window = time.perf_counter() - t1
        reference = (work / "straight" / "checkpoint" / "model.safetensors").read_bytes()
        print(f"uninterrupted run: {args.steps} steps; {window:.1f} s from its first logged step to its exit "
              f"(each kill lands 0-{window:.1f} s after a start logs a step)", flush=True)
        results = []
        for i in range(args.runs):
            r = one_run(work / f"run{i}", args.steps, args.kills, window, rng)
            same = r["weights"] == reference
            print(f"run {i}: {r['resumes']} resumes, {r['failed']} failed, final weights "
                  f"{'bit-identical' if same else 'DIFFERENT'}", flush=True)
            results.append((r, same))
        resumes = sum(r["resumes"] for r, _ in results)
        failed = sum(r["failed"] for r, _ in results)
        identical = sum(same for _, same in results)
        print(f"{resumes - failed}/{resumes} resumes succeeded; {identical}/{args.runs} final checkpoints "
              f"bit-identical to the uninterrupted run ({args.runs} runs x {args.kills} SIGKILLs, "
              f"{args.steps} steps, {time.perf_counter() - t0:.0f} s)")
        return 0 if failed == 0 and identical == args.runs else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
