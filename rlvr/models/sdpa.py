"""Which fused attention kernels rlvr's forwards let torch choose on an NVIDIA GPU.

Rule: on CUDA, cuDNN's attention is switched off. Why: ``F.scaled_dot_product_attention`` with a
boolean mask may choose cuDNN's attention kernel for a decode-shaped call, and cuDNN builds an
execution plan per new shape, a first call many times slower than the later ones; the
memory-efficient kernel has no first-call cost. Sampling meets a new key length at every decode
step, and training meets new shapes whenever response lengths change (figures:
docs/benchmarks.md, "On a GPU"). So on CUDA every rlvr forward runs with cuDNN's attention
switched off; torch still chooses among flash, memory-efficient and math attention as it would.
Elsewhere (CPU, MPS) nothing changes.
"""

from __future__ import annotations

import contextlib

import torch


def gpu_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a forward on `device` runs in: on CUDA, SDPA restricted to the flash,
    memory-efficient and math kernels (no cuDNN attention; see the module docstring); elsewhere,
    or on a torch without ``torch.nn.attention.sdpa_kernel``, a context that changes nothing."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - torch < 2.3 has neither sdpa_kernel nor cuDNN attention
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
