"""The band over seeds of every example's held-out figure: what the README's examples table states.

    python benchmarks/seed_bands.py                               # every examples/*.toml, 3 seeds
    python benchmarks/seed_bands.py examples/sort.toml --seeds 10 --threads 2 1 --json runs/seed_bands.json
    python benchmarks/seed_bands.py examples/sort.toml --seeds 3 --algorithm.entropy_coef=0.03   # overrides too

One seed on one machine is one draw (float rounding differs with the CPU, the thread count and the
library versions), so a claim about an example is a band: each config is trained over `--seeds`
seeds (0, 1, ...) at each thread count of `--threads` (0 = the config's own), one run after the
other, each in its own process with nothing else of this script running beside it. For each it
prints the held-out goal at the start (when the config evaluates at step 0) and at the end, the
training seconds by which the held-out goal first reached `--target` (the sum of the steps'
`time/step_s`, evaluations excluded; "-" when it never did), and then the band: the lowest, median
and highest final goal, how many seeds reached the target, the median and slowest time to it. It
ends with the machine (CPU model, torch threads) the band was measured on, and the command.
A finished run already in the output directory with the same configuration is read, not re-run.
Exits 1 when a seed of a config with a target ended below it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seed_claims import train  # noqa: E402  (one run in its own process, or the finished one read back)

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"sort.toml": 0.99}
"""The held-out goal an example promises at its end; examples without one report their band only."""


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run_figures(rows: list[dict], target: float | None) -> dict:
    """Start and end held-out goal, training seconds and steps to the target, of one run's metrics rows."""
    evals = [r for r in rows if "eval/goal" in r]
    steps = [r for r in rows if "train/reward" in r]
    start = next((e["eval/goal"] for e in evals if e["step"] == 0), None)
    hit = next((e for e in evals if target is not None and e["step"] > 0 and e["eval/goal"] >= target), None)
    seconds = (sum(r.get("time/step_s", 0.0) for r in steps if r["step"] <= hit["step"]) if hit else None)
    return {"start": start, "end": evals[-1]["eval/goal"] if evals else None, "steps": len(steps),
            "seconds_to_target": seconds, "step_to_target": hit["step"] if hit else None,
            "train_seconds": sum(r.get("time/step_s", 0.0) for r in steps)}


def band(runs: dict[int, dict], target: float | None) -> dict:
    """Lowest, median and highest final goal over seeds; seeds at the target; median and slowest time to it."""
    ends = [r["end"] for r in runs.values() if r["end"] is not None]
    times = [r["seconds_to_target"] for r in runs.values() if r["seconds_to_target"] is not None]
    out = {"seeds": len(runs), "end_min": min(ends), "end_median": statistics.median(ends), "end_max": max(ends)}
    if target is not None:
        out.update(reached=sum(e >= target for e in ends), target=target,
                   median_seconds_to_target=statistics.median(times) if times else None,
                   slowest_seconds_to_target=max(times) if len(times) == len(runs) else None)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="*", help="example configs (default: every examples/*.toml)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (default 3)")
    ap.add_argument("--threads", type=int, nargs="+", default=[0], help="train.threads values; 0 = the config's")
    ap.add_argument("--target", type=float, default=None, help="held-out goal to reach (default: per example)")
    ap.add_argument("--out", default="runs/seed_bands", help="directory of the runs (default runs/seed_bands)")
    ap.add_argument("--json", default="", help="also write the figures here")
    args, extra = ap.parse_known_args()   # the rest: --section.key=value overrides passed to every run
    bad = [o for o in extra if not (o.startswith("--") and "=" in o and "." in o.split("=", 1)[0])]
    if bad:
        ap.error(f"unrecognised arguments {bad}: overrides look like --train.steps=100")
    configs = args.configs or sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.toml"))
    results, missed = {}, False
    for config in configs:
        target = args.target if args.target is not None else TARGETS.get(Path(config).name)
        for threads in args.threads:
            key = f"{config} threads={threads or 'config'}"
            runs = {}
            for seed in range(args.seeds):
                out = Path(args.out) / f"{Path(config).stem}-t{threads}-s{seed}"
                runs[seed] = run_figures(train(out, config, {}, seed, extra, threads), target)
                r = runs[seed]
                print(f"{key} seed {seed}: held-out goal {r['start'] if r['start'] is not None else '-'} -> "
                      f"{r['end']:.3f} in {r['steps']} steps ({r['train_seconds']:.1f} s of training); "
                      f"to {target}: " + (f"{r['seconds_to_target']:.1f} s (step {r['step_to_target']})"
                                          if r["seconds_to_target"] is not None else "-"), flush=True)
            b = band(runs, target)
            results[key] = {"runs": runs, "band": b}
            line = f"{key}: final held-out goal {b['end_min']:.3f} / {b['end_median']:.3f} / {b['end_max']:.3f} " \
                   f"(min / median / max over {b['seeds']} seeds)"
            if target is not None:
                med, slow = b["median_seconds_to_target"], b["slowest_seconds_to_target"]
                line += (f"; {b['reached']}/{b['seeds']} reached {target}; time to it: median "
                         f"{'-' if med is None else f'{med:.1f} s'}, slowest {'-' if slow is None else f'{slow:.1f} s'}")
                missed |= b["reached"] < b["seeds"]
            print(line, flush=True)
    machine = f"{cpu_model()}, {platform.machine()}, python {platform.python_version()}"
    print(f"machine: {machine}")
    print("command: python benchmarks/seed_bands.py " + " ".join(sys.argv[1:]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
