"""The floor that a decode step's matrix products set on this CPU: the products of one decode step
of SmolLM2-135M's shapes (30 layers of stacked q/k/v, o, stacked gate/up and down, then the
49,152-token head; random weights, so no download) at a few row counts, computed three ways and
alternated in rounds in one process:

- ``packed``: bf16 from oneDNN's prepacked layout (``torch.ops.mkldnn._linear_pointwise``), what
  rlvr's bf16 decode reads on CPUs where its probes allow it (``rlvr.models.lean_llama``);
- ``bf16``: ``F.linear`` on plain bf16 weights (what autocast computes);
- ``fp32``: ``F.linear`` on float32 weights (MKL; twice the bytes).

    python benchmarks/decode_products.py [--rows 1,8,24,64] [--rounds 5] [--threads 2]

Prints, per row count and way, the median milliseconds a step over the rounds, the rate the
weights were streamed at, and the ratio to decode's bound at those rows: max(weight bytes / copy
bandwidth, FLOPs / bf16 matmul rate), both measured at the start of the run (the bound
``benchmarks/real_model.py`` sets decode against, without the KV cache's bytes). The weights of a
step (260 MiB in bf16) are larger than the caches, so each product reads its weight from memory,
as in a decode step. No LoRA factors, attention, norms or sampling: the products alone.
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


def weights(dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """One decode step's weights, in the order the step reads them: each layer's, then the head."""
    ws = [torch.randn(*SHAPES[k], generator=gen).mul_(0.02).to(dtype) for _ in range(LAYERS) for k in SHAPES]
    return ws + [torch.randn(*HEAD, generator=gen).mul_(0.02).to(dtype)]


def step_fn(way: str, ws: list[torch.Tensor], rows: int):
    """A function computing every product of one decode step at ``rows`` rows in ``way``."""
    xs = {K: torch.randn(rows, K).to(ws[0].dtype) for K in {W.size(1) for W in ws}}
    if way == "packed":
        packs = [torch.ops.mkldnn._reorder_linear_weight(W, PACK_ROWS) for W in ws]
        Ks = [W.size(1) for W in ws]
        return lambda: [torch.ops.mkldnn._linear_pointwise(xs[K], P, None, "none", [], "") for K, P in zip(Ks, packs)]
    return lambda: [F.linear(xs[W.size(1)], W) for W in ws]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,24,64", help="comma-separated row counts")
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds (each way once a round)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    packed_ok = hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()
    ways = (["packed"] if packed_ok else []) + ["bf16", "fp32"]
    gen = torch.Generator().manual_seed(0)
    w_bf16 = weights(torch.bfloat16, gen)
    w_fp32 = [W.float() for W in w_bf16]
    bw, rate = copy_bandwidth(), product_rate(torch.bfloat16)
    nbytes = sum(W.numel() for W in w_bf16) * 2
    print(f"machine: copy bandwidth {bw / 1e9:.2f} GB/s, bf16 matmul rate {rate / 1e9:.1f} GFLOP/s "
          f"(torch threads {a.threads}); one step's weights {nbytes / 2**20:.0f} MiB in bf16"
          + ("" if packed_ok else "; oneDNN's packed linear is not available here"))
    print(f"command: python benchmarks/decode_products.py --rows {a.rows} --rounds {a.rounds} --threads {a.threads}")
    for rows in (int(r) for r in a.rows.split(",")):
        fns = {w: step_fn(w, w_fp32 if w == "fp32" else w_bf16, rows) for w in ways}
        for f in fns.values():
            f()                                                                     # warm-up (and the packs' first use)
        times: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(a.rounds):
            for w, f in fns.items():
                t = time.perf_counter()
                f()
                times[w].append(time.perf_counter() - t)
        flops = 2 * rows * nbytes / 2
        bound = max(nbytes / bw, flops / rate)
        for w in ways:
            s = statistics.median(times[w])
            streamed = nbytes * (2 if w == "fp32" else 1) / s
            print(f"  {rows:>3} rows  {w:<6} {s * 1e3:7.1f} ms a step  weights streamed at {streamed / 1e9:5.2f} GB/s "
                  f"({streamed / bw:.2f} of the copy bandwidth)  {s / bound:4.1f}x decode's bound ({bound * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
