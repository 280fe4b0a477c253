"""FSDP2 for the learner group (`distributed.sharding = "fsdp2"`): parameters, gradients and AdamW state
split over the learner ranks with torch's `fully_shard`.

Each rank trains a copy of the policy whose transformer blocks are each wrapped with `fully_shard`,
then the root (embeddings, final norm and head form one more unit). Every parameter becomes a
DTensor holding about 1/N of its rows on each rank. A block's full weights are all-gathered for its
forward and again for its backward, then freed; its gradients are reduce-scattered and averaged over
the ranks, as DDP's all-reduce averages them, so the loss scale of rlvr.distributed.learners.Shard
gives the one-process gradient here too. `clip_grad_norm_` over DTensor gradients returns the
global norm (a DTensor replicated on every rank), and AdamW steps each rank's shard with its shard
of the moments: the one-process update, split by rows.

Memory per rank, fp32 with P trainable parameters: DDP holds 4P weights + 4P gradients + 8P AdamW
moments = 16P bytes on every rank; FSDP2 holds 16P / N plus the full weights of the block being
computed (and the activations, which neither shards).

Rank 0 keeps two copies of the model: `learner.policy`, an ordinary full module that samples,
evaluates, is saved and is sent to the rollout workers, and its sharded training copy. After every
update the training copy's trainable parameters are gathered (`DTensor.full_tensor()`, a collective
every rank joins) into `learner.policy`. The price is one full copy of the weights (4P bytes) on
rank 0 only, next to its 16P / N shard, like a hybrid engine's inference copy; gathering the weights
for every sampling call instead would make sampling a collective of the whole group.

Saving: while the group runs, rank 0's `learner.opt` is a `GatheredOptimizer` whose `state_dict()`
gathers the full AdamW state (`get_optimizer_state_dict(..., full_state_dict=True)`, a collective)
and renames it to the one-process format, and `learner.sched` is the training copy's scheduler. So
rlvr.state saves exactly what one process saves, and a run resumes with any learner layout: at start
every rank loads the one-process state into its shard (`set_optimizer_state_dict`).
"""

from __future__ import annotations

import contextlib

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from rlvr.learn import Learner, make_optimizer, make_scheduler
from rlvr.setup_types import RunError


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of `model`: the items of the nn.ModuleList with the most parameters among
    those whose items are all of one class (TinyTransformer.blocks, a Hugging Face Llama's
    model.layers, also under peft). Empty when there is none: the whole model is then one unit."""
    best: list[nn.Module] = []
    most = 0
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1:
            n = sum(p.numel() for p in m.parameters())
            if n > most:
                best, most = list(m), n
    return best


def shard(model: nn.Module) -> nn.Module:
    """`fully_shard` each block of `model`, then the root, over every rank of the process group (a 1-D
    mesh on the model's device type). In place; returns `model`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(iter(model.parameters())).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def sharded_learner(model, cfg, state: dict, generator: torch.Generator, max_len: int,
                    flops: tuple[int, int] = (0, 0), autocast=contextlib.nullcontext) -> Learner:
    """A rank's training learner: `model` (holding rank 0's weights) sharded, AdamW and the schedule over
    its shards, rank 0's optimizer state (`state["opt"]`, one-process format) and schedule
    (`state["sched"]`) loaded. Every rank of the group calls it at the same time (collectives)."""
    model = shard(model)
    opt = make_optimizer(model.trainable_params(), cfg.train)
    load_optimizer_state(model, opt, state["opt"])
    sched = make_scheduler(opt, cfg.train)
    sched.load_state_dict({**state["sched"], "lr_lambdas": [None] * len(opt.param_groups)})
    return Learner(model, opt, sched, cfg, generator, max_len, flops, autocast=autocast)


def _names(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's order: the one-process state dict keys them 0, 1, ... in it."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in opt.param_groups for p in g["params"]]


def full_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The whole AdamW state, gathered from every rank's shard (a collective: every rank calls it): on
    rank 0 in the format of one process's `opt.state_dict()` (state keyed by parameter index, CPU
    tensors), on the other ranks {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return {}
    index = {n: i for i, n in enumerate(_names(model, opt))}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in sd["param_groups"]]
    return {"state": {index[n]: dict(st) for n, st in sd["state"].items()}, "param_groups": groups}


def load_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, sd: dict) -> None:
    """Every rank: the one-process optimizer state `sd` (keyed by parameter index) into this rank's shard
    of it; the hyper-parameters of each group (the scheduled lr among them) are copied as they are."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if len(sd["param_groups"]) != len(opt.param_groups):
        raise RunError(f"the saved optimizer has {len(sd['param_groups'])} parameter groups, this one "
                       f"{len(opt.param_groups)} (a different model?)")
    for group, saved in zip(opt.param_groups, sd["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    if not sd["state"]:  # a fresh run: no moments yet
        return
    names = _names(model, opt)
    by_name = {"state": {names[int(i)]: st for i, st in sd["state"].items()},
               "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in sd["param_groups"]]}
    set_optimizer_state_dict(model, opt, by_name, options=StateDictOptions(full_state_dict=True))


@torch.no_grad()
def gather_weights(model: nn.Module, into: nn.Module | None = None) -> None:
    """Gather the full value of every trainable parameter of the sharded `model` (a collective: every rank
    calls it, after each update) and copy it into the same-named parameter of `into` (rank 0's
    ordinary policy; None on the other ranks, which drop it). One parameter at a time, so a rank holds
    at most one extra full tensor."""
    target = dict(into.named_parameters()) if into is not None else {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor()
            if into is not None:
                target[name].copy_(full)


class GatheredOptimizer:
    """Rank 0's `learner.opt` while an FSDP2 learner group trains: what rlvr.state reads when it saves.
    `state_dict()` returns the whole AdamW state in the one-process format, gathered from the ranks'
    shards by `gather` (a collective the group runs); the optimizer itself is the training copy's
    (`sharded`), stepped by the group, never through this object."""

    def __init__(self, gather: Callable[[], dict], sharded: torch.optim.Optimizer):
        self._gather, self._sharded = gather, sharded

    @property
    def param_groups(self) -> list[dict]:
        return self._sharded.param_groups

    def state_dict(self) -> dict:
        return self._gather()

    def load_state_dict(self, state: dict) -> None:
        raise RunError("the optimizer state of an FSDP2 learner group is loaded when the group starts "
                       "(restore the run's state before opening [distributed])")
