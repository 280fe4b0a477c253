"""Bytes each learner rank holds under distributed.sharding = ddp and fsdp2, counted from the tensors.

    python benchmarks/fsdp_memory.py examples/sort.toml [--learners 2] [--model.n_layer=4 ...]

Starts N gloo processes on this machine (torch.multiprocessing, no Ray), builds the run's policy in
each (rlvr.build.build), shards it as the learner group does (rlvr.distributed.fsdp.shard), gives every
trainable parameter a zero gradient and takes one AdamW step (so the moments exist), then sums what
each rank holds: weights, gradients and AdamW state (a DTensor counts its local shard). DDP's row is
the same sum over the unsharded model, which every DDP rank holds whole. Rank 0 also keeps the
trainer's full copy of the weights under fsdp2 (printed apart). Activations and the gathered
weights of the block being computed are not counted. No timing is taken.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of the part of `t` this rank stores (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def held(model, opt) -> dict[str, int]:
    params = model.trainable_params()
    moments = sum(local_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim())
    return {"weights": sum(local_bytes(p) for p in model.parameters()),
            "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None), "adamw": moments}


def one_step(model, cfg) -> dict[str, int]:
    from rlvr.learn import make_optimizer

    opt = make_optimizer(model.trainable_params(), cfg.train)
    for p in model.trainable_params():
        p.grad = torch.zeros_like(p)
    opt.step()
    return held(model, opt)


def rank_main(rank: int, world: int, port: int, cfg_path: str, overrides: list[str], out) -> None:
    torch.set_num_threads(1)
    from rlvr import build as build_mod, config as config_mod
    from rlvr.distributed import fsdp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cfg = config_mod.load(cfg_path, overrides)
    model = build_mod.build(cfg, log=lambda *_: None).model
    full = one_step(model, cfg) if rank == 0 else None          # what a DDP rank (or one process) holds
    fsdp.shard(model)
    out.put((rank, full, one_step(model, cfg)))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--learners", type=int, default=2)
    args, overrides = ap.parse_known_args()  # the rest: config overrides (--model.lora_r=0 ...)
    args.overrides = [x for x in overrides if x != "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    ctx_procs = mp.spawn(rank_main, args=(args.learners, port, args.config, args.overrides, q),
                         nprocs=args.learners, join=False)
    got = sorted(q.get() for _ in range(args.learners))
    ctx_procs.join()
    mib = 1 / 2**20
    full = got[0][1]

    def row(name: str, d: dict) -> str:
        return (f"| {name} | {d['weights'] * mib:,.2f} | {d['gradients'] * mib:,.2f} | {d['adamw'] * mib:,.2f} | "
                f"{sum(d.values()) * mib:,.2f} |")

    print(f"{args.config} {' '.join(args.overrides)}: {args.learners} learners, MiB per rank")
    print("| rank | weights | gradients | AdamW state | total |\n|---|---|---|---|---|")
    print(row("ddp (every rank)", full))
    for rank, _, d in got:
        print(row(f"fsdp2 rank {rank}", d))
    print(f"fsdp2 rank 0 also holds the trainer's full weights: {full['weights'] * mib:,.2f} MiB")


if __name__ == "__main__":
    main()
