"""Weight sync and actor plumbing: what crosses process boundaries, and how big it is.

A rollout worker holds its own copy of the policy. It is built once from the trainer's full
``state_dict`` (weights and buffers, CPU tensors, one ``ray.put``); after every update it receives
only the trainable parameters (``trainable_state``: under LoRA the adapter alone), tagged with the
policy version they make. The bytes of one sync are Σ numel × element size of those tensors
(``state_bytes``); every worker reads the same object from Ray's object store.
"""

from __future__ import annotations

import os

import torch

from rlvr.setup_types import RunError

LOOPBACK = "127.0.0.1"
"""The address a local Ray's processes listen on."""


def full_state(policy) -> dict[str, torch.Tensor]:
    """Every weight and buffer of `policy` as contiguous CPU tensors (a worker's starting copy)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in policy.state_dict().items()}


def trainable_state(policy) -> dict[str, torch.Tensor]:
    """The parameters the optimizer updates, by name, as CPU tensors: what one weight sync sends.
    A tied parameter appears once (``named_parameters`` drops duplicates)."""
    return {k: p.detach().to("cpu", copy=True).contiguous() for k, p in policy.named_parameters() if p.requires_grad}


def load_weights(policy, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` (full or trainable only) into `policy`; a name the policy lacks is an error."""
    missing = set(state) - set(policy.state_dict())
    if missing:
        raise RunError(f"weight sync: the worker's policy has no {sorted(missing)[:3]} (a different model?)")
    with torch.no_grad():
        policy.load_state_dict(state, strict=False)


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of one sync: parameters × bytes per parameter."""
    return sum(v.numel() * v.element_size() for v in state.values())


def init_local_ray(ray, num_cpus: int) -> None:
    """``ray.init`` of a Ray on this machine alone: its processes (GCS, raylet, workers, agents) listen
    on the loopback address only (``_node_ip_address`` 127.0.0.1, with Ray's "no cluster" switch, the
    one it uses on macOS, held off during the start, since otherwise Ray trades a loopback address
    for the machine's own), and no dashboard. Ray versions that enable token authentication for a new
    local cluster do so here too (docs/security.md)."""
    try:
        from ray._private import ray_constants
    except ImportError:  # pragma: no cover - a Ray without the module: the node address alone
        ray_constants = None
    saved = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    if saved is not None:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, _node_ip_address=LOOPBACK)
    finally:
        if saved is not None:
            ray_constants.ENABLE_RAY_CLUSTER = saved


def start_ray(address: str, cpus_needed: float):
    """Join the cluster at `address` ("auto", "ray://...", "HOST:PORT"), or start a local Ray when it
    is empty (listening on loopback only, no dashboard: :func:`init_local_ray`; logical CPUs at least
    `cpus_needed`, so the actors can be placed on a small machine). Returns True when this call
    started Ray (and the caller should shut it down)."""
    try:
        import ray
    except ImportError:
        raise RunError("[distributed] needs Ray: pip install 'rlvr[distributed]'") from None
    if ray.is_initialized():
        _check_cpus(ray, cpus_needed, started=False)
        return False
    try:
        if address:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        else:
            # actors inherit this process's environment (PYTHONPATH)
            init_local_ray(ray, max(os.cpu_count() or 1, int(cpus_needed + 0.999)))
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RunError(f"distributed.address = {address!r}: cannot start or join Ray: {e}") from None
    _check_cpus(ray, cpus_needed, started=True)
    return True


def _check_cpus(ray, cpus_needed: float, started: bool) -> None:
    """RunError (and no actor waiting forever for a CPU) when the cluster has fewer CPUs than asked."""
    have = ray.cluster_resources().get("CPU", 0)
    if have < cpus_needed:
        if started:
            ray.shutdown()
        raise RunError(f"the Ray cluster has {have:g} CPUs; the actors ask for {cpus_needed:g} "
                       "(distributed.cpus_per_worker × actors): lower cpus_per_worker or add nodes")
