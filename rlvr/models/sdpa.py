"""Which fused attention kernels rlvr's forwards let torch choose on an NVIDIA GPU.

Measured on an NVIDIA H200 (torch 2.11, CUDA 13): ``F.scaled_dot_product_attention`` with a
boolean mask chose cuDNN's attention kernel for a decode-shaped call (256 rows, 5 key/value heads
of 4 query heads, one query, 50-83 keys, bf16). cuDNN builds an execution plan per new shape: the
first call at each new key length took 0.07 to 1.3 s, later ones 0.4 ms. The memory-efficient
kernel took 0.1 ms a call, with no first-call cost. Sampling meets a new key length at every
decode step (the first step of a 128-token run took 17.5 s there, the later ones 3.6 s), and
training meets new shapes whenever response lengths change. So on CUDA every rlvr forward runs with cuDNN's attention
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
