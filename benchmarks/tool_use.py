"""Does a policy learn to use a tool, and to use an environment's feedback? Two tasks only those can solve.

    python benchmarks/tool_use.py [--runs NAME ...] [--steps N] [--out runs/tool_use] [--section.key=value ...]

Each run is the real command `rlvr train` from the same random built-in model (2 layers, d = 64),
P = 32, G = 8, one after the other; the script prints the held-out goal (200 prompts, greedy) at
step 0, by step and at the end, the tool calls per held-out response and the wall time.

* lookup (`lookup_task`): the prompt is a 3-digit key ("482?"), the answer a 3-digit hash of it
  that no other key tells. The task's tool reads the key and inserts "=VALUE" when the response
  writes "#" (the stop string). `lookup_tool` (max_tool_calls = 1) against `lookup_no_tool` (0):
  with the tool the policy learns to call it and stop after the value; without it a guess is right
  1 time in 1000.
* guess (rlvr.tasks.guess, compact style, 0 to 9): a secret digit hides behind a 4-digit key (a
  hash). Each guess ends at the end token; the task's environment (rlvr.tasks.guess.GuessGame, with
  sampling.tool_on_end) answers "<" or ">" and the policy guesses again, up to 4 guesses; a right
  guess ends the episode. `guess_feedback` against
  `guess_one_shot` (one guess, no feedback inserted): one guess is right 1 time in 10, four random ones
  about 1 in 3; a policy that reads the feedback and halves the range wins every episode.
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
path = "{task}"
reward = "{reward}"
options = {options}

[model]
n_layer = 2
n_head = 4
n_embd = 64

[sampling]
{sampling}

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

GUESS = "rlvr.tasks.guess:guess_task"
GUESS_OPTIONS = '{ low = 0, high = 9, style = "compact", train = 4000 }'
RUNS = {
    # name: (task path, options, reward, [sampling] lines, default steps); "{here}" is this file
    "lookup_tool": ("{here}:lookup_task", "{}", "correct", 'stop = ["#"]\nmax_tool_calls = 1', 60),
    "lookup_no_tool": ("{here}:lookup_task", "{}", "correct", 'stop = ["#"]\nmax_tool_calls = 0', 60),
    "guess_feedback": (GUESS, GUESS_OPTIONS, "guessed", "max_tool_calls = 3\ntool_on_end = true", 1200),
    "guess_one_shot": (GUESS, GUESS_OPTIONS, "guessed", "max_tool_calls = 0", 1200),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--steps", type=int, default=0, help="steps of every run (default: each run's own)")
    ap.add_argument("--out", default="runs/tool_use")
    args, extra = ap.parse_known_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.runs:
        task, options, reward, sampling_lines, steps = RUNS[name]
        steps = args.steps or steps
        config = out / f"{name}.toml"
        config.write_text(CONFIG.format(task=task.replace("{here}", str(Path(__file__).resolve())), options=options,
                                        reward=reward, sampling=sampling_lines, steps=steps,
                                        every=max(1, steps // 6)))
        run = out / name
        cmd = ["rlvr", "train", str(config), "--out", str(run), "--overwrite", *extra]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval/goal" in r]
        summary = json.loads((run / "summary.json").read_text())
        rows.append((name, evals, summary))
    print(f"\n{'run':<16} {'goal at 0':>9} {'goal at end':>11} {'calls/response':>14} {'train s':>8}  "
          "held-out goal by step")
    for name, evals, s in rows:
        trail = " -> ".join(f"{e['eval/goal']:.2f}@{e['step']}" for e in evals)
        print(f"{name:<16} {evals[0]['eval/goal']:>9.3f} {evals[-1]['eval/goal']:>11.3f} "
              f"{evals[-1].get('eval/tool_calls_per_response', 0.0):>14.2f} {s['wall_seconds']:>8.1f}  {trail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
