"""How a training process takes host memory from the C library (``train.host_memory``).

An RL step on the CPU allocates the same large temporaries again and again: a decode step's
(rows, vocabulary) logits and the sampler's passes over them (12.6 MB each for 64 rows of
SmolLM2's 49,152 tokens), the training forward's logits blocks and activations (tens to hundreds
of MB). glibc's malloc serves blocks above a threshold with fresh ``mmap`` pages and hands them
back to the kernel on free, and trims the heap's free top; every step then faults its temporaries
in again, page by page, each page zeroed by the kernel.

``keep``: ask glibc to serve every block from its heap (``M_MMAP_MAX = 0``) and never trim that
heap (``M_TRIM_THRESHOLD = -1``), so freed blocks are reused by the next step without touching the
kernel: a few page faults a step once the heap has reached its peak, and a shorter step. The
process's resident set then stays at its peak (as a GPU caching allocator does), somewhat above
glibc's own. ``system``: glibc's defaults.

``auto`` (the default): ``keep``, except in a run with gradient checkpointing, which takes
``system``. Such a run chose recomputation to save memory, and under ``keep`` the heap it leaves
behind ate most of the saving. The figures are in docs/benchmarks.md ("Figures behind the code's
rules", "Memory").

Only glibc has these knobs (``mallopt``); elsewhere ``keep`` does nothing and says so. A process
keeps the setting once made (glibc's dynamic defaults cannot be restored), so ``system`` after
``keep`` in one process reports that.
"""

from __future__ import annotations

import ctypes
import platform

HOST_MEMORY = ("auto", "keep", "system")
"""The values of ``train.host_memory``."""

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4   # glibc's mallopt parameter numbers (malloc.h)
_kept: bool = False


def resolve(mode: str, checkpointing: bool) -> str:
    """The setting ``train.host_memory = mode`` takes (``keep`` or ``system``): ``auto`` is ``system``
    in a run with gradient checkpointing (``model.gradient_checkpointing``), else ``keep``."""
    if mode not in HOST_MEMORY:
        raise ValueError(f"train.host_memory must be one of {', '.join(HOST_MEMORY)}, got {mode!r}")
    if mode != "auto":
        return mode
    return "system" if checkpointing else "keep"


def set_host_memory(mode: str, checkpointing: bool = False) -> str:
    """Apply ``train.host_memory`` to this process (``checkpointing``: the run's
    ``model.gradient_checkpointing``, which ``auto`` reads); returns a line saying what holds now."""
    why = ("train.host_memory = auto with model.gradient_checkpointing: memory goes back between steps"
           if mode == "auto" and checkpointing else "train.host_memory = system")
    return _apply(resolve(mode, checkpointing), why)


def _apply(mode: str, why: str) -> str:
    global _kept
    if mode == "system":
        return ("host memory: kept by an earlier run in this process (glibc's defaults cannot be restored)"
                if _kept else f"host memory: the C library's defaults ({why})")
    if _kept:
        return "host memory: kept (glibc: no mmap, no trim)"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"host memory: the C library's defaults (train.host_memory = keep needs glibc; this is " \
               f"{platform.system()} {platform.libc_ver()[0] or 'without glibc'})"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "host memory: the C library's defaults (no mallopt found)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_MAX, 0) != 1 or mallopt(_M_TRIM_THRESHOLD, -1) != 1:
        return "host memory: the C library's defaults (mallopt refused)"
    _kept = True
    return "host memory: kept (glibc: no mmap, no trim)"
