"""Predicted against measured peak memory of a short real run.

    python benchmarks/memory_peak.py examples/sort.toml --train.steps=5
    python benchmarks/memory_peak.py examples/smollm2_add.toml --train.steps=1 --eval.prompts=8 --eval.at_start=false

Runs `rlvr train CONFIG [OVERRIDES]` in a child process (into a temporary run directory), reads
the predicted peak from the run's price.json (`memory_peak_bytes`, rlvr.memory_model.memory) and the
child's measured peak resident set (getrusage(RUSAGE_CHILDREN).ru_maxrss, the high-water mark of
VmRSS), and prints both with their ratio.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(config: str, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="rlvr_mem_") as d:
        out = Path(d) / "run"
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "rlvr.cli", "train", config, "--out", str(out), *overrides],
                              capture_output=True, text=True)
        wall = time.perf_counter() - t
        if proc.returncode:
            raise SystemExit(f"the run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        price = json.loads((out / "price.json").read_text())
    measured = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024   # KiB on Linux
    predicted = price["memory_peak_bytes"]
    parts = {k: price[k] for k in ("memory_baseline_bytes", "policy_bytes", "reference_bytes", "optimizer_bytes",
                                   "memory_gradient_bytes", "memory_activation_bytes", "memory_logits_bytes",
                                   "memory_kv_cache_bytes", "memory_eval_kv_cache_bytes", "memory_export_bytes",
                                   "memory_weight_copy_bytes", "memory_kept_copy_bytes") if k in price}
    return {"config": config, "overrides": overrides, "predicted_peak_bytes": predicted,
            "measured_peak_bytes": measured, "ratio": predicted / measured, "phase": price["memory_peak_phase"],
            "parts": parts, "wall_s": wall}


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    r = measure(argv[0], argv[1:])
    mib = 1 / 2**20
    print(f"{r['config']} {' '.join(r['overrides'])}")
    print(f"  predicted peak {r['predicted_peak_bytes'] * mib:,.0f} MiB (during {r['phase']}), "
          f"measured peak RSS {r['measured_peak_bytes'] * mib:,.0f} MiB, predicted / measured = {r['ratio']:.2f}; "
          f"run wall {r['wall_s']:.0f} s")
    print("  parts (MiB): " + ", ".join(f"{k.replace('memory_', '').replace('_bytes', '')} {v * mib:,.1f}"
                                        for k, v in r["parts"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
