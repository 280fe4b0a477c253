"""One table that tests the claims rlvr's design rests on, on the sort task with the built-in model.

    python benchmarks/seed_claims.py [--seeds 3] [--jobs 2] [--out runs/seed_claims] [--json runs/seed_claims.json]
    python benchmarks/seed_claims.py --quick        # a smoke run: tiny model, 3-digit lists, few steps, 1 seed

Every row is a real `rlvr train` run of examples/sort.toml with a few overrides, repeated over
seeds; `--jobs N` runs N of them at once in separate processes, each with cores / N threads (on 2
cores, 2 one-thread runs finish a table sooner than one 2-thread run after the other). Variants
that resolve to the same configuration (the base run appears in several claims) are run once, and
a run whose directory already holds a finished run of the same configuration is read, not re-run,
so an interrupted table continues where it stopped; variants of one claim get the same budget of SAMPLED
TOKENS (P · G · steps · T is held fixed, so G = 16 samples fewer prompts than G = 2). For each it
prints the held-out goal at the end and at its best, the sampled tokens by which the held-out goal
first reached the target (0.99; "-" and the best reached when it never did), and the figure the claim
is about (non-zero Δ fraction, clip fraction, whether the proxy was gamed). Then one line per claim
says what the figures show under a stated rule, including when they do not confirm it.

Claims:
  schemes     `centered` and `normalized` are similar in small runs; `loo` against `centered`
  exact       `exact` from a random policy never starts (non-zero Δ fraction ≈ 0)
  gamed       a dense proxy (`inclusion_adjacency`) gets gamed: training reward rises while the
              held-out goal falls, or the budget by which that had not happened yet
  group       G = 2, 4, 8, 16 at equal sampled tokens
  epochs      μ = 1, 2, 4 passes per batch, with clip fractions
  learned     the learned baseline with G = 1 against `normalized` with G = 8 at equal sampled tokens
  process     `position_per_token` (per-token Δ) against `position`
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BASE = {"P": 64, "G": 8, "steps": 800}          # examples/sort.toml
QUICK = {"P": 8, "G": 4, "steps": 6}
QUICK_ARGS = ["--task.options={n = 3, heldout = 50}", "--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2",
              "--eval.prompts=50", "--eval.pass_k=0", "--eval.every=2", "--train.threads=1"]


def variants(base: dict) -> dict[str, list[tuple[str, dict]]]:
    """claim -> [(variant name, overrides)], P and G adjusted so each claim's variants sample alike."""
    P, G = base["P"], base["G"]
    PG = P * G
    return {
        "schemes": [(s, {"algorithm.scheme": s}) for s in ("centered", "normalized", "loo")],
        "exact": [("exact", {"task.reward": "exact"})],
        "gamed": [("inclusion_adjacency", {"task.reward": "inclusion_adjacency"})],
        "group": [(f"G={g}", {"train.samples_per_prompt": g, "train.prompts_per_step": max(1, PG // g)})
                  for g in (2, 4, 8, 16)],
        "epochs": [(f"mu={m}", {"train.epochs_per_batch": m, "train.minibatches": 2}) for m in (1, 2, 4)],
        "learned": [("learned G=1", {"algorithm.scheme": "learned", "train.samples_per_prompt": 1,
                                     "train.prompts_per_step": PG, "algorithm.value_lr": 0.01}),
                    ("normalized G=8", {"algorithm.scheme": "normalized", "train.samples_per_prompt": 8,
                                        "train.prompts_per_step": max(1, PG // 8)})],
        "process": [("position_per_token", {"task.reward": "position_per_token"}),
                    ("position", {"task.reward": "position"})],
    }


def resolved(config: str, overrides: dict, seed: int, extra: list[str]) -> dict:
    """The full configuration a run of these overrides trains with (what makes two variants the same run)."""
    from rlvr import config as config_mod

    cfg = config_mod.load(config, [f"--train.seed={seed}", *extra, *(f"--{k}={v}" for k, v in overrides.items())])
    return config_mod.to_dict(cfg)


def train(out: Path, config: str, overrides: dict, seed: int, extra: list[str], threads: int) -> list[dict]:
    """One `rlvr train` run in its own process (or the finished run already in `out`); its metrics rows."""
    argv = ["train", config, "--out", str(out), "--overwrite", f"--train.seed={seed}", *extra,
            *(f"--{k}={v}" for k, v in overrides.items())]
    if threads:
        argv.append(f"--train.threads={threads}")
    metrics, summary = out / "metrics.jsonl", out / "summary.json"
    if summary.exists() and not json.loads(summary.read_text()).get("interrupted") and (out / "config.toml").exists():
        from rlvr import config as config_mod

        want = resolved(config, overrides, seed, [*extra, *([f"--train.threads={threads}"] if threads else [])])
        if config_mod.to_dict(config_mod.load(out / "config.toml")) == want:   # the same run, finished
            return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    proc = subprocess.run([sys.executable, "-c", "import sys; from rlvr.cli import main; sys.exit(main(sys.argv[1:]))",
                           *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"rlvr {' '.join(argv)} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def figures(rows: list[dict], target: float) -> dict:
    """Held-out goal at the end and best, sampled tokens to the target, Δ and clip figures, gaming."""
    train = {r["step"]: r for r in rows if "train/reward" in r}
    evals = [r for r in rows if "eval/goal" in r]
    tokens_at = {s: r["train/sampled_tokens"] for s, r in train.items()}
    hit = next((e for e in evals if e["eval/goal"] >= target), None)
    best = max(evals, key=lambda e: e["eval/goal"])
    mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in train.values())  # noqa: E731
    # gamed: after the held-out goal's best evaluation, the goal fell by 0.05 or more while the
    # training reward (mean over the steps since the previous evaluation) was higher than at the best
    gamed_at = None
    steps = sorted(train)
    window = lambda s: [train[t]["train/reward"] for t in steps if s - 5 < t <= s]  # noqa: E731
    for e in evals:
        if e["step"] > best["step"] and e["eval/goal"] <= best["eval/goal"] - 0.05 and window(e["step"]) \
                and statistics.fmean(window(e["step"])) > statistics.fmean(window(best["step"]) or [0.0]):
            gamed_at = tokens_at.get(e["step"])
            break
    return {
        "goal": evals[-1]["eval/goal"], "best_goal": best["eval/goal"],
        "tokens_to_target": tokens_at.get(hit["step"]) if hit else None,
        "sampled_tokens": tokens_at[steps[-1]], "train_reward": train[steps[-1]]["train/reward"],
        "nonzero_delta": mean("train/nonzero_delta_frac"), "clip_frac": mean("train/clip_frac"),
        "gamed_at_tokens": gamed_at,
    }


def summarise(runs: list[dict]) -> dict:
    """Mean (and spread) over seeds."""
    def ms(k):
        xs = [r[k] for r in runs]
        return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)
    hits = [r["tokens_to_target"] for r in runs if r["tokens_to_target"] is not None]
    gamed = [r["gamed_at_tokens"] for r in runs if r["gamed_at_tokens"] is not None]
    return {"goal": ms("goal"), "best_goal": ms("best_goal"), "nonzero_delta": ms("nonzero_delta")[0],
            "clip_frac": ms("clip_frac")[0], "train_reward": ms("train_reward")[0],
            "reached": f"{len(hits)}/{len(runs)}", "tokens_to_target": statistics.fmean(hits) if hits else None,
            "gamed": f"{len(gamed)}/{len(runs)}", "gamed_at_tokens": min(gamed) if gamed else None,
            "sampled_tokens": max(r["sampled_tokens"] for r in runs)}


def reading(claim: str, rows: dict[str, dict]) -> str:
    """What the figures say about the claim, by a stated rule (never more than the numbers hold)."""
    g = {k: v["goal"][0] for k, v in rows.items()}
    if claim in ("schemes", "group", "learned", "process") and max(g.values()) < 0.05:
        return "no variant reached a held-out goal of 0.05 at this budget: the figures say nothing about the claim"
    spread = lambda *ks: max(g[k] for k in ks) - min(g[k] for k in ks)  # noqa: E731
    if claim == "schemes":
        d = spread("centered", "normalized")
        return (f"centered vs normalized differ by {d:.3f} held-out goal: "
                + ("similar (< 0.05), as claimed" if d < 0.05 else "NOT similar at this budget (>= 0.05)")
                + f"; loo - centered = {g['loo'] - g['centered']:+.3f}")
    if claim == "exact":
        nz = rows["exact"]["nonzero_delta"]
        return (f"non-zero Δ fraction {nz:.4f}: " + ("the run never starts, as claimed" if nz < 0.01
                                                      else "it does start (>= 0.01): claim NOT confirmed"))
    if claim == "gamed":
        r = rows["inclusion_adjacency"]
        return (f"gamed in {r['gamed']} seeds" + (f", first at {r['gamed_at_tokens']:,} sampled tokens"
                                                  if r["gamed_at_tokens"] else
                                                  f"; not yet by {r['sampled_tokens']:,} sampled tokens (claim not shown at this budget)"))
    if claim == "group":
        best = max(g, key=g.get)
        return f"at equal sampled tokens the best held-out goal is {best} ({g[best]:.3f}); " + \
            ", ".join(f"{k} {v:.3f}" for k, v in g.items())
    if claim == "epochs":
        return ", ".join(f"{k}: goal {rows[k]['goal'][0]:.3f}, clip {rows[k]['clip_frac']:.3f}" for k in rows) + \
            (" (clip fraction rises with μ, as expected)" if rows["mu=4"]["clip_frac"] > rows["mu=1"]["clip_frac"]
             else " (clip fraction does NOT rise with μ here)")
    if claim == "learned":
        d = g["learned G=1"] - g["normalized G=8"]
        return f"learned G=1 - normalized G=8 = {d:+.3f} held-out goal at equal sampled tokens"
    if claim == "process":
        d = g["position_per_token"] - g["position"]
        return f"position_per_token - position = {d:+.3f} held-out goal"
    return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/sort.toml")
    ap.add_argument("--out", default="runs/seed_claims")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--target-goal", type=float, default=0.99)
    ap.add_argument("--claims", nargs="+", default=None, help="a subset of the claims (default: all)")
    ap.add_argument("--quick", action="store_true", help="tiny model, 3-digit lists, 6 steps, 1 seed (a smoke run)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process with cores / jobs threads")
    ap.add_argument("--json", default="")
    args, extra = ap.parse_known_args()
    base = QUICK if args.quick else BASE
    seeds = 1 if args.quick else args.seeds
    extra = ([*QUICK_ARGS, f"--train.steps={base['steps']}", f"--train.prompts_per_step={base['P']}",
              f"--train.samples_per_prompt={base['G']}"] if args.quick else []) + extra
    table = variants(base)
    jobs = max(1, args.jobs)
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else 0
    # every distinct (configuration, seed) once; the first variant naming it gives its directory
    planned: dict[str, tuple[Path, dict, int]] = {}
    keys: dict[tuple[str, str], list[str]] = {}
    for claim, vs in table.items():
        if args.claims and claim not in args.claims:
            continue
        for name, overrides in vs:
            keys[claim, name] = []
            for seed in range(seeds):
                key = json.dumps(resolved(args.config, overrides, seed, extra), sort_keys=True, default=str)
                out = Path(args.out) / claim / name.replace(" ", "_").replace("=", "") / f"seed{seed}"
                planned.setdefault(key, (out, overrides, seed))
                keys[claim, name].append(key)
    print(f"{len(planned)} distinct runs, {jobs} at a time", file=sys.stderr, flush=True)

    def run_one(key: str) -> tuple[str, dict]:
        out, overrides, seed = planned[key]
        rows = train(out, args.config, overrides, seed, extra, threads)
        print(f"done {out}", file=sys.stderr, flush=True)
        return key, figures(rows, args.target_goal)

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        figs = dict(pool.map(run_one, list(planned)))
    results: dict[str, dict[str, dict]] = {}
    for (claim, name), ks in keys.items():
        results.setdefault(claim, {})[name] = summarise([figs[k] for k in ks])

    print(f"\n{'claim':<8} {'variant':<20} {'held-out goal':>15} {'best':>6} {'reached':>7} {'tokens to target':>16} "
          f"{'nonzero Δ':>9} {'clip':>6} {'gamed':>5}")
    for claim, rows in results.items():
        for name, s in rows.items():
            goal = f"{s['goal'][0]:.3f}±{s['goal'][1]:.3f}"
            tt = f"{s['tokens_to_target']:,.0f}" if s["tokens_to_target"] else "-"
            print(f"{claim:<8} {name:<20} {goal:>15} {s['best_goal'][0]:>6.3f} {s['reached']:>7} {tt:>16} "
                  f"{s['nonzero_delta']:>9.3f} {s['clip_frac']:>6.3f} {s['gamed']:>5}")
    print()
    for claim, rows in results.items():
        print(f"{claim}: {reading(claim, rows)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"seeds": seeds, "quick": args.quick, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
