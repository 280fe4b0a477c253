"""Step time of a real `rlvr train` run with a slow reward: in-process scoring against reward workers.

    python benchmarks/reward_pool_step.py [--ms 50] [--workers 2] [--steps 4]

The sort task (5 digits, built-in model) with its `position` reward wrapped to take ``--ms``
milliseconds (time.sleep: a reward that waits on a checker process or a service). P x G = 8 x 8 = 64
responses a step. The same run twice, side by side in this process: `task.reward_workers = 0`
(scored in the trainer) and `= --workers`; prints the median `time/step_s` of each (the first step
excluded: it starts the workers) and their ratio (target: at most 0.6 with 2 workers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import textwrap
from pathlib import Path

from rlvr import config
from rlvr.trainer import train

TASK = textwrap.dedent('''
    import time
    from rlvr.rewards import Reward
    from rlvr.tasks.sort import sort_task

    def make(ms=50.0, **options):
        task = sort_task(**options)
        base = task.rewards["position"]

        def slow_position(prompt, response, answer):
            time.sleep(ms / 1000)
            return base.fn(prompt, response, answer)

        task.rewards["slow_position"] = Reward("slow_position", slow_position, base.card)
        return task
''')


def run(workers: int, args, tmp: Path) -> list[float]:
    task = tmp / "slow_task.py"
    task.write_text(TASK)
    cfg = config.load(None, [
        f"--task.path={task}:make", f"--task.options={{ms = {args.ms}, n = 5, heldout = 8}}",
        "--task.reward=slow_position", f"--task.reward_workers={workers}",
        "--model.n_layer=2", "--model.n_embd=64", "--model.n_head=4",
        f"--train.steps={args.steps}", "--train.prompts_per_step=8", "--train.samples_per_prompt=8",
        "--train.threads=1", "--eval.every=0", "--eval.pass_k=0", "--eval.prompts=8", "--log.print_every=1000",
    ])
    out = tmp / f"run{workers}"
    train(cfg, out, log=lambda *_: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["time/step_s"] for r in rows if "time/step_s" in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", type=float, default=50.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        inproc = statistics.median(run(0, args, Path(d))[1:])
        pooled = statistics.median(run(args.workers, args, Path(d))[1:])
    print(f"command: python benchmarks/reward_pool_step.py --ms {args.ms:g} --workers {args.workers} --steps {args.steps}")
    print(f"step time, 64 responses x {args.ms:g} ms reward: in-process {inproc:.3f} s, "
          f"{args.workers} reward workers {pooled:.3f} s, ratio {pooled / inproc:.2f} (target <= 0.6)")


if __name__ == "__main__":
    main()
