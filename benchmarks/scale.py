"""Step time and weight-sync time of a training step in-process against 1 and 2 Ray rollout workers.

    python benchmarks/scale.py [--steps 4] [--prompts 32] [--models sort,llama] [--json out.json]

Equal work in every column: the same P prompts x G samples per step, the same model and seed, the
learn stage in the trainer process. `sort` is the built-in model of examples/sort.toml (2 layers,
d = 64); `llama` is a random 4-layer d = 256 Llama (tests/configs/make_tiny_hf_model.py) on the same
task. Reported per step, after one warm-up step: the whole step, its sampling part (submit to
merged groups) and the weight sync (ray.put of the trainable parameters + every worker loaded
them), with the bytes one sync sends. On a machine with fewer cores than workers + trainer the
workers share cores with the trainer: the figure measured there is the overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "configs"))  # make_tiny_hf_model

from rlvr import build as build_mod, config as config_mod  # noqa: E402
from rlvr.distributed import Distributed  # noqa: E402
from rlvr.learn import Learner, learn, make_optimizer, make_scheduler  # noqa: E402
from rlvr.rollout import rollout  # noqa: E402
from make_tiny_hf_model import build  # noqa: E402  (tests/configs: the random Llama)


def measure(overrides: list[str], workers: int, steps: int) -> dict:
    cfg = config_mod.load(ROOT / "examples" / "sort.toml", overrides + [f"--distributed.rollout_workers={workers}"])
    setup = build_mod.build(cfg, log=lambda *_: None)
    opt = make_optimizer(setup.model.trainable_params(), cfg.train)
    learner = Learner(setup.model, opt, make_scheduler(opt, cfg.train), cfg, torch.Generator().manual_seed(1),
                      setup.limits.max_new_tokens)
    gen, rng = torch.Generator().manual_seed(0), torch.Generator().manual_seed(2)
    P = cfg.train.prompts_per_step

    def draw():
        return [setup.task.train[i] for i in torch.randperm(len(setup.task.train), generator=rng)[:P].tolist()]

    d = Distributed(cfg, setup, learner, 0, 0, log=lambda *_: None, builder=build_mod.build) if workers else None
    times = {"step_s": [], "sample_s": [], "sync_s": []}
    try:
        for s in range(steps + 1):
            t0 = time.perf_counter()
            batch = (d.rollout if d else rollout)(setup, setup.model, None, draw, version=s, generator=gen)
            stats = (d.learn if d else learn)(learner, batch)
            if s:  # the first step warms up (actor start, first weights)
                times["step_s"].append(time.perf_counter() - t0)
                times["sample_s"].append(batch.sample_s)
                times["sync_s"].append(stats.get("sync_s", 0.0))
        sync_mb = d.workers.sync_bytes / 1e6 if d else 0.0
    finally:
        if d:
            d.close()
    return {**{k: sum(v) / len(v) for k, v in times.items()}, "sync_MB": sync_mb}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--models", default="sort,llama")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import ray

    torch.set_num_threads(1)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    common = [f"--train.prompts_per_step={args.prompts}", "--train.threads=1", "--task.reward_workers=0",
              "--distributed.cpus_per_worker=1", "--eval.every=0"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {"sort": []}
        if "llama" in args.models:
            build(Path(tmp) / "llama", layers=4, hidden=256, heads=4, context=64)
            models["llama"] = [f"--model.path={Path(tmp) / 'llama'}"]
        for name in [m for m in args.models.split(",") if m in models]:
            for workers in (0, 1, 2):
                results[f"{name}/{workers}"] = measure(common + models[name], workers, args.steps)
    ray.shutdown()
    print(f"python benchmarks/scale.py --steps {args.steps} --prompts {args.prompts} --models {args.models}")
    print(f"{'model':<7}{'workers':>8}{'step s':>9}{'sample s':>10}{'sync s':>9}{'sync MB':>9}")
    for key, r in results.items():
        name, workers = key.split("/")
        label = "in-proc" if workers == "0" else workers
        print(f"{name:<7}{label:>8}{r['step_s']:>9.3f}{r['sample_s']:>10.3f}{r['sync_s']:>9.4f}{r['sync_MB']:>9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
