"""Does a policy learn to call a tool? A lookup task only a tool can answer, trained with and without tool calls.

    python benchmarks/tool_use.py [--steps N] [--out runs/tool_use] [--section.key=value ...]

The task (`lookup_task`, defined here): the prompt is a 3-digit key and a question mark ("482?");
the answer is a 3-digit value of a hash of the key that the policy cannot compute and that
no training example repeats for a held-out key. The task's tool reads the key from the prompt and answers
"=VALUE". A response calls it by writing "#" (the run's stop string); the tool's text is inserted
(attended, never trained on) and sampling goes on. The reward and the goal: the last three digits
of the response, inserted text included, are the answer.

Runs the real command `rlvr train` twice from the same random built-in model, one after the other:
`sampling.max_tool_calls = 1`, and 0 (the same stop string ends the response, no tool). Prints the
held-out goal at step 0 and at the end, the tool calls per held-out response, and wall time. What a
working tool loop predicts: with the tool the policy learns to write "#" and stop after the
inserted value (goal -> 1); without it the goal stays near chance (1 in 1000 per guess).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
from pathlib import Path

from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Example, Task


def value(key: str) -> str:
    """The hidden value of a key: a 3-digit hash the policy cannot learn from other keys."""
    return f"{(int(key) * 7919 + 13) * 104729 % 1000:03d}"


def lookup(prompt: str, response: str, answer: str) -> str:
    """The task's tool: the value of the prompt's key, as "=VALUE" (reads the prompt, not the answer)."""
    return "=" + value(prompt[:3])


def correct(prompt: str, response: str, answer: str) -> float:
    found = re.findall(r"\d{3}", response)
    return 1.0 if found and found[-1] == answer else 0.0


def lookup_task(heldout: int = 200, seed: int = 0) -> Task:
    keys = [f"{k:03d}" for k in range(1000)]
    random.Random(seed).shuffle(keys)
    ex = [Example(prompt=k + "?", answer=value(k)) for k in keys]
    card = RewardCard(pays_for="a response whose last three digits are the key's value (inserted text included)",
                      ignores="how the value got there: calling the tool and stopping is the intended way",
                      exploit="none known that fails the goal: it is the goal's own check")
    return Task(name="lookup", train=ex[heldout:], heldout=ex[:heldout],
                rewards={"correct": Reward("correct", correct, card)}, goal=lambda p, r, a: correct(p, r, a) == 1.0,
                max_new_tokens=8, alphabet="0123456789?#=", tool=lookup)


CONFIG = """[task]
path = "{path}:lookup_task"
reward = "correct"

[model]
n_layer = 2
n_head = 4
n_embd = 64

[sampling]
stop = ["#"]
max_tool_calls = {calls}

[algorithm]
scheme = "normalized"

[train]
steps = {steps}
prompts_per_step = 32
samples_per_prompt = 8
lr = 1e-3
seed = 0

[eval]
every = {every}
pass_k = 0
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default="runs/tool_use")
    args, extra = ap.parse_known_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for calls in (1, 0):
        config = out / f"tool_calls_{calls}.toml"
        config.write_text(CONFIG.format(path=Path(__file__).resolve(), calls=calls, steps=args.steps,
                                        every=max(1, args.steps // 3)))
        run = out / f"tool_calls_{calls}"
        cmd = ["rlvr", "train", str(config), "--out", str(run), "--overwrite", *extra]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval/goal" in r]
        summary = json.loads((run / "summary.json").read_text())
        rows.append((calls, evals, summary))
    print(f"\n{'max_tool_calls':>14} {'goal at 0':>9} {'goal at end':>11} {'calls/response':>14} {'train s':>8}  "
          "held-out goal by step")
    for calls, evals, s in rows:
        trail = " -> ".join(f"{e['eval/goal']:.2f}@{e['step']}" for e in evals)
        print(f"{calls:>14} {evals[0]['eval/goal']:>9.3f} {evals[-1]['eval/goal']:>11.3f} "
              f"{evals[-1].get('eval/tool_calls_per_response', 0.0):>14.2f} {s['wall_seconds']:>8.1f}  {trail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
