"""Scoring time of a slow reward: in the trainer's process against a pool of reward workers, side by side.

    python benchmarks/reward_pool.py [--calls 64] [--ms 50] [--workers 2] [--repeats 3]

A task whose reward takes ``--ms`` milliseconds, once waiting (``time.sleep``: a reward that calls a
service or a subprocess) and once computing (a busy loop: a pure-Python checker), scored on ``--calls``
responses (P x G of one step) by :func:`rlvr.rewards.score_batch`, first in-process, then through a
:class:`rlvr.reward_pool.RewardPool` of ``--workers`` workers. Prints the best of ``--repeats`` for each
and the ratio pool / in-process (target: at most 0.6 with 2 workers). The computing case can only gain
as many times as there are idle cores.
"""

from __future__ import annotations

import argparse
import tempfile
import textwrap
import time
from pathlib import Path

from rlvr.reward_pool import RewardPool
from rlvr.rewards import score_batch
from rlvr.tasks import load_task, weighted_rewards

TASK = textwrap.dedent('''
    import time
    from rlvr.rewards import Reward, RewardCard
    from rlvr.tasks import Example, Task

    CARD = RewardCard(pays_for="nothing", ignores="everything", exploit="none: a timing fixture")

    def make(ms=50.0):
        def waiting(prompt, response, answer):
            time.sleep(ms / 1000)
            return 1.0

        def computing(prompt, response, answer):
            end = time.perf_counter() + ms / 1000
            while time.perf_counter() < end:
                pass
            return 1.0

        return Task(name="slow", train=[Example("p", "a")], heldout=[Example("h", "a")], goal=lambda p, r, a: True,
                    max_new_tokens=1, rewards={"waiting": Reward("waiting", waiting, CARD),
                                               "computing": Reward("computing", computing, CARD)})
''')


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--ms", type=float, default=50.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "slow_task.py"
        path.write_text(TASK)
        spec = f"{path}:make"
        task = load_task(spec, ms=args.ms)
        rows = (["p"] * args.calls, ["r"] * args.calls, ["a"] * args.calls)
        with RewardPool(spec, {"ms": args.ms}, workers=args.workers) as pool:
            for name in ("waiting", "computing"):
                weights = weighted_rewards(task, {name: 1.0})
                here = best_of(args.repeats, lambda: score_batch(weights, *rows))
                there = best_of(args.repeats, lambda: score_batch(weights, *rows, pool=pool))
                print(f"{name:>9}: {args.calls} calls x {args.ms:g} ms: in-process {here:.3f} s, "
                      f"{args.workers} workers {there:.3f} s, ratio {there / here:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
