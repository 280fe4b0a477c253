"""The learner group: torch.distributed (gloo on CPU, NCCL on CUDA) with DDP or FSDP2, the update of one process.

Rank 0 is the trainer process (its `Learner` is the one saved and evaluated); ranks 1..N-1 are Ray
actors (`LearnerActor`) that start from rank 0's weights, optimizer, schedule and minibatch
generator. Every rank receives the whole batch and draws the same minibatch order from its
generator, then takes its share of each minibatch in whole groups (`shard_rows`).

The update equals the single-process update because:
  1. the loss of rank r is rescaled to  world · loss_r · den_r / Σ_r den_r  with den the count its
     aggregation divides by (rlvr.losses.denominator: the token count for token_mean, the row count
     otherwise), Σ_r den_r found by an all_reduce of the ranks' mask sums; DDP averages the ranks'
     gradients (÷ world), so the gradient is Σ_r ∇(loss_r · den_r) / Σ_r den_r: the gradient of the
     aggregation over the whole minibatch. Averaging per-rank token means instead would weigh a
     token of a rank with few tokens more than one of a rank with many.
  2. after DDP's all-reduce every rank holds the same gradient, so the global-norm clip and the
     AdamW step are the same on every rank and the weights stay equal.

With `distributed.sharding = "fsdp2"` (rlvr.distributed.fsdp) the ranks train sharded copies instead:
FSDP2's reduce-scatter averages the gradients over the ranks as DDP does, so point 1 holds as it is;
each rank then holds its rows of the averaged gradient, the clip uses the global norm, and AdamW
steps each rank's rows. Rank 0 gathers the full weights into the trainer's policy after the update.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import urllib.parse
from typing import Callable

import torch
import torch.distributed as dist

from rlvr import losses
from rlvr.learn import Learner, learn
from rlvr.rollout import Batch


class DDPPolicy:
    """A Policy whose forward goes through DistributedDataParallel (gradient all-reduce in backward);
    every other member is the wrapped model's."""

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel):
        self._ddp = ddp

    def __call__(self, *args, **kwargs):
        return self._ddp(*args, **kwargs)

    def shared_prompt_logits(self, ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, group_size: int,
                             float_logits: bool = True):
        """The wrapped model's one-pass shared-prompt logits (an HFPolicy's ``shared_prompt_logits``),
        computed through DDP's forward as ``__call__`` is, so the backward all-reduces their
        gradients; None where the model has no such pass now."""
        if not getattr(self._ddp.module, "one_pass_shared_prompt", False):
            return None
        return self._ddp(ids, attention_mask=attention_mask, shared_prompt=(prompt_len, group_size),
                         float_logits=float_logits)

    def no_sync(self):
        """DDP's context in which backward passes accumulate gradients without the all-reduce (the next
        backward outside it averages what was accumulated): rlvr.learn.accumulate's parts but the last."""
        return self._ddp.no_sync()

    def __getattr__(self, name):
        return getattr(self._ddp.module, name)


def shard_rows(idx: torch.Tensor, G: int, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s rows of minibatch `idx` (whole groups of G rows, contiguous, as even as possible)."""
    groups = idx.view(-1, G)                                       # (n_groups, G)
    base, extra = divmod(groups.shape[0], world)
    first = rank * base + min(rank, extra)
    return groups[first:first + base + (1 if rank < extra else 0)].reshape(-1)


def _all_reduce(x: torch.Tensor, op=None) -> torch.Tensor:
    dist.all_reduce(x, op=op or dist.ReduceOp.SUM)
    return x


class Shard:
    """Rank `rank` of a learner group of `world`, as rlvr.learn.learn's `shard=` sees it: its whole
    groups of each minibatch, the loss scale of point 1 above, and the statistics reduced over the ranks."""

    def __init__(self, rank: int, world: int, model):
        self.rank, self.world, self.model = rank, world, model
        """`model`: the policy as the forward should see it (a DDPPolicy when world > 1)."""
        self.share = 1.0

    def mine(self, idx: torch.Tensor, G: int) -> torch.Tensor:
        """This rank's rows of minibatch `idx` (`shard_rows`; empty when it has fewer groups than ranks)."""
        return shard_rows(idx, G, self.rank, self.world)

    def rows(self, idx: torch.Tensor, G: int, mask: torch.Tensor, agg: str) -> tuple[torch.Tensor, float]:
        """(this rank's rows of minibatch `idx`, the loss scale world · den_r / Σ_r den_r)."""
        mine = self.mine(idx, G)
        empty = mine.numel() == 0  # fewer groups than ranks (dynamic sampling kept few): run one, weigh 0,
        if empty:                  # since DDP needs a backward from every rank
            mine = idx[:G]
        den = losses.denominator(mask[mine], agg) * (0.0 if empty else 1.0)
        total = _all_reduce(den.clone()) if self.world > 1 else den
        self.share = float(den / total.clamp(min=1))
        return mine, self.world * self.share   # DDP averages over ranks: Σ_r share_r ∇loss_r

    def gather_rows(self, tensors: dict, own: torch.Tensor) -> dict:
        """Every rank's rows of `tensors` ((B, T) each, this rank's own at the rows where `own` (B,) is
        True, each row some one rank's) on every rank: each rank's own rows, zero elsewhere, summed
        over the ranks (adding zeros: exact). rlvr.learn.learn's logp_old from the ranks' first pass,
        which later passes draw in other minibatches and so on other ranks."""
        if self.world == 1:
            return tensors
        rows = own.view(-1, 1)                                         # (B, 1)
        return {k: _all_reduce(torch.where(rows, v, torch.zeros((), dtype=v.dtype, device=v.device)))
                for k, v in tensors.items()}

    def reduce(self, stats: dict) -> dict:
        """Statistics of the whole minibatch from the ranks' own: *_min by min, *_max by max, the others
        as means weighted by each rank's share of the denominator."""
        if self.world == 1:
            return stats
        keys = sorted(stats)
        mean = _all_reduce(torch.tensor([stats[k] * self.share for k in keys], dtype=torch.float64))
        lo = _all_reduce(torch.tensor([stats[k] for k in keys], dtype=torch.float64), dist.ReduceOp.MIN)
        hi = _all_reduce(torch.tensor([stats[k] for k in keys], dtype=torch.float64), dist.ReduceOp.MAX)
        return {k: float(lo[i] if k.endswith("_min") else hi[i] if k.endswith("_max") else mean[i])
                for i, k in enumerate(keys)}


LOOPBACK = "127.0.0.1"
"""The group's address without Ray, or with the local Ray (rlvr.distributed.sync.start_ray binds it there)."""
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""The variables that name the network interface gloo and NCCL open their own connections on."""


def group_host() -> str:
    """The address rank 0's store listens on: this node's Ray address (loopback for a local Ray, a
    cluster node's own address otherwise), or loopback without Ray."""
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else LOOPBACK
    except Exception:  # noqa: BLE001 -- no Ray: a one-machine group
        return LOOPBACK


def open_rendezvous(host: str | None = None) -> tuple[socket.socket, str]:
    """(a listening socket on ``host`` (default :func:`group_host`) and an ephemeral port, its
    ``tcp://HOST:PORT``). Rank 0's store takes the socket over (``init_group(listener=)``), so the port is
    never free between choosing it and using it (no other process can take it), and it is bound to
    that one address, not every interface. The caller closes its copy after the group has started."""
    host = host or group_host()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    port = listener.getsockname()[1]
    return listener, f"tcp://[{host}]:{port}" if family == socket.AF_INET6 else f"tcp://{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address) is this machine's loopback."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS); None if not found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:  # pragma: no cover
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def keep_on_loopback(init_method: str, environ=os.environ) -> None:
    """A group whose rendezvous is on loopback has every rank on this machine: gloo's and NCCL's own
    connections go on the loopback interface too (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, each
    unless already set), instead of the address the host name resolves to."""
    host = urllib.parse.urlsplit(init_method).hostname or ""
    lo = loopback_interface()
    if lo and is_loopback(host):
        for name in IFNAME_VARIABLES:
            environ.setdefault(name, lo)


def init_group(device: torch.device, rank: int, world: int, init_method: str, timeout_s: float,
               listener: socket.socket | None = None) -> None:
    """Join the process group as `rank`: gloo on CPU, NCCL when the policy is on CUDA. Rank 0 passes the
    `listener` of :func:`open_rendezvous`, on which its store serves the others."""
    keep_on_loopback(init_method)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    url = urllib.parse.urlsplit(init_method)
    if listener is None:     # every rank passes its own store, so all see the same keys
        store = dist.TCPStore(url.hostname, url.port, world, False, timeout)
    else:
        store = dist.TCPStore(url.hostname, url.port, world, True, timeout, wait_for_workers=False,
                              master_listen_fd=os.dup(listener.fileno()))  # the store closes its copy
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def join_group(learner: Learner, rank: int, world: int, init_method: str, timeout_s: float,
               listener: socket.socket | None = None) -> DDPPolicy:
    """Join the process group as `rank` and wrap the policy in DDP (whose constructor broadcasts rank 0's
    weights)."""
    device = next(iter(learner.policy.parameters())).device
    init_group(device, rank, world, init_method, timeout_s, listener)
    ids = [device.index] if device.type == "cuda" else None
    return DDPPolicy(torch.nn.parallel.DistributedDataParallel(learner.policy, device_ids=ids))


def learner_state(learner: Learner) -> dict:
    """What a new rank copies from rank 0: weights, optimizer, schedule, minibatch generator."""
    from rlvr.distributed.sync import full_state

    return {"model": full_state(learner.policy), "opt": learner.opt.state_dict(),
            "sched": {k: v for k, v in learner.sched.state_dict().items() if k != "lr_lambdas"},
            "gen": learner.generator.get_state()}


class LearnerActor:
    """Ranks 1..N-1 (wrapped with ``ray.remote`` by ``LearnerGroup``): a copy of rank 0's learner, whole
    (DDP) or sharded (FSDP2, rlvr.distributed.fsdp). `builder(cfg, log=...) -> Setup` builds it (the
    trainer passes rlvr.build.build)."""

    def __init__(self, cfg, threads: int, builder: Callable):
        torch.set_num_threads(threads)
        from rlvr.hostmem import set_host_memory

        # as the trainer's process does (rlvr.hostmem)
        set_host_memory(cfg.train.host_memory, cfg.model.gradient_checkpointing)
        self.cfg, self.setup = cfg, builder(cfg, log=lambda *_: None)
        self.learner = self.model = None
        self.fsdp = cfg.distributed.sharding == "fsdp2"

    def join(self, state: dict, rank: int, world: int, init_method: str, timeout_s: float) -> int:
        import rlvr.distributed.fsdp as fsdp
        from rlvr.distributed.sync import load_weights
        from rlvr.learn import make_optimizer, make_scheduler

        cfg, setup = self.cfg, self.setup
        load_weights(setup.model, state["model"])
        gen = torch.Generator(device=setup.device)
        gen.set_state(state["gen"])
        self.rank, self.world = rank, world
        if self.fsdp:
            init_group(setup.device, rank, world, init_method, timeout_s)
            self.learner = fsdp.sharded_learner(setup.model, cfg, state, gen, setup.limits.max_new_tokens,
                                                autocast=setup.numerics.context)
            self.model = self.learner.policy
            return rank
        opt = make_optimizer(setup.model.trainable_params(), cfg.train)
        opt.load_state_dict(state["opt"])
        sched = make_scheduler(opt, cfg.train)
        sched.load_state_dict({**state["sched"], "lr_lambdas": [None] * len(opt.param_groups)})
        self.learner = Learner(setup.model, opt, sched, cfg, gen, setup.limits.max_new_tokens,
                               autocast=setup.numerics.context)
        self.model = join_group(self.learner, rank, world, init_method, timeout_s)
        return rank

    def learn(self, batch: Batch, delta_rows) -> dict:
        import rlvr.distributed.fsdp as fsdp

        stats = learn(self.learner, batch, delta_rows=delta_rows, shard=Shard(self.rank, self.world, self.model))
        if self.fsdp:
            fsdp.gather_weights(self.model)  # rank 0 keeps them
        return stats

    def optimizer_state(self) -> None:
        """This rank's part of the gathering of the whole optimizer state (FSDP2; rank 0 keeps it)."""
        import rlvr.distributed.fsdp as fsdp

        fsdp.full_optimizer_state(self.model, self.learner.opt)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class LearnerGroup:
    """Rank 0 (the trainer's `learner`, in this process) and N-1 LearnerActors, one process group.

    With `distributed.sharding = "fsdp2"` rank 0 trains a sharded copy (`self.train`) and the trainer's
    `learner` changes: its policy receives the full weights after every update, its `opt` becomes a
    rlvr.distributed.fsdp.GatheredOptimizer (saving gathers the whole optimizer state) and its `sched`
    the sharded copy's scheduler. `builder(cfg, log=...) -> Setup`: how each actor builds its copy (the
    trainer passes rlvr.build.build; a function reference, pickled by name)."""

    def __init__(self, cfg, learner: Learner, builder: Callable):
        import copy

        import ray

        import rlvr.distributed.fsdp as fsdp
        from rlvr.machine import actor_threads

        d = cfg.distributed
        self.learner, self.world, self.timeout = learner, d.learners, d.timeout_s
        self.fsdp = d.sharding == "fsdp2"
        actor = ray.remote(LearnerActor).options(num_cpus=d.cpus_per_worker, num_gpus=d.gpus_per_worker)
        self.actors = [actor.remote(cfg, actor_threads(d.cpus_per_worker), builder) for _ in range(self.world - 1)]
        listener = None
        try:     # a failed start leaves no process group or actor behind (the caller gets no object to close)
            listener, init = open_rendezvous()
            state = learner_state(learner)
            ref = ray.put(state)
            joins = [a.join.remote(ref, r + 1, self.world, init, self.timeout) for r, a in enumerate(self.actors)]
            if self.fsdp:
                init_group(next(iter(learner.policy.parameters())).device, 0, self.world, init, self.timeout,
                           listener)
                self.train = fsdp.sharded_learner(copy.deepcopy(learner.policy), cfg, state, learner.generator,
                                                  learner.max_len, learner.flops, autocast=learner.autocast)
                self.model = self.train.policy
                learner.opt = fsdp.GatheredOptimizer(self.full_optimizer_state, self.train.opt)
                learner.sched = self.train.sched
            else:
                self.train, self.model = learner, join_group(learner, 0, self.world, init, self.timeout, listener)
            del state
            self._wait(joins, "start")
        except BaseException:
            self.close()
            raise
        finally:
            if listener is not None:
                listener.close()

    def _wait(self, refs: list, what: str):
        """ray.get(refs) within the timeout; a lost rank is a RunError that says to resume."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        from rlvr.setup_types import RunError

        try:
            return ray.get(refs, timeout=self.timeout)
        except (RayActorError, GetTimeoutError) as e:
            raise RunError(f"the learner group lost a rank during the {what} ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200]}); continue the run with --resume") from None

    def learn(self, batch: Batch, delta_rows: torch.Tensor | None = None) -> dict:
        """One update on every rank (then, with FSDP2, the full weights into the trainer's policy); rank
        0's statistics (already reduced over the group)."""
        import ray

        import rlvr.distributed.fsdp as fsdp

        b_ref = ray.put(batch)
        refs = [a.learn.remote(b_ref, delta_rows) for a in self.actors]
        stats = learn(self.train, batch, delta_rows=delta_rows, shard=Shard(0, self.world, self.model))
        if self.fsdp:
            fsdp.gather_weights(self.model, into=self.learner.policy)
        self._wait(refs, "update")
        return stats

    def full_optimizer_state(self) -> dict:
        """The whole optimizer state in the one-process format, gathered from the ranks' shards (FSDP2;
        what saving reads through the trainer's `learner.opt`)."""
        import rlvr.distributed.fsdp as fsdp
        from rlvr.setup_types import RunError

        if not self.actors:
            raise RunError("the FSDP2 learner group is closed: its optimizer state is gone")
        refs = [a.optimizer_state.remote() for a in self.actors]
        sd = fsdp.full_optimizer_state(self.model, self.train.opt)
        self._wait(refs, "optimizer state gathering")
        return sd

    def close(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.get(a.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 -- closing: an actor already gone is fine
                pass
            ray.kill(a)
        self.actors = []
        if dist.is_initialized():
            dist.destroy_process_group()
        self.model = None  # DDP's hold on the process group, and so on its store's listening socket
