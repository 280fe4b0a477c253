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

``auto`` (the default): ``jemalloc`` for a Hugging Face model trained on the CPU, with or without
gradient checkpointing, where the ``rlvr`` command owns its process and this machine has the
library (``auto_takes_jemalloc``); else ``keep``, except in a run with gradient checkpointing, which
takes ``system``. Such a run chose recomputation to save memory, and under ``keep`` the heap it
leaves behind ate most of the saving; jemalloc's peak was lower still. A real model's learn stage
frees large activations that fragment glibc's heap (below); the built-in tiny model's steps
allocate small blocks, which glibc serves faster than jemalloc. The figures are in
docs/benchmarks.md ("Figures behind the code's rules", "Memory").

Only glibc has these knobs (``mallopt``); elsewhere ``keep`` does nothing and says so. A process
keeps the setting once made (glibc's dynamic defaults cannot be restored), so ``system`` after
``keep`` in one process reports that.

``jemalloc``: ``rlvr train`` runs itself again with jemalloc preloaded (``preload_env``; the
system's library, else the copy Ray's wheel ships) before it builds anything. glibc serves a large
block by best fit, walking the free blocks of a size class one by one; after a learn stage has
freed its activations around blocks that live on, a class holds hundreds of free blocks, and every
later allocation of a decode step or a forward walks them. jemalloc's size classes do not. Only a
library this machine's loader finds, or Ray's own copy, is ever preloaded: never a path from a
config.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from pathlib import Path

HOST_MEMORY = ("auto", "keep", "system", "jemalloc")
"""The values of ``train.host_memory``."""

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4   # glibc's mallopt parameter numbers (malloc.h)
_kept: bool = False


def resolve(mode: str, checkpointing: bool) -> str:
    """The setting ``train.host_memory = mode`` takes in this process: ``auto`` is ``jemalloc`` in a
    process rlvr started with jemalloc preloaded (``preload_env``), else ``system`` in a run with
    gradient checkpointing (``model.gradient_checkpointing``), else ``keep``."""
    if mode not in HOST_MEMORY:
        raise ValueError(f"train.host_memory must be one of {', '.join(HOST_MEMORY)}, got {mode!r}")
    if mode != "auto":
        return mode
    if _rlvr_preloaded():
        return "jemalloc"
    return "system" if checkpointing else "keep"


def auto_takes_jemalloc(hf_model: bool, device: str) -> bool:
    """Whether ``train.host_memory = auto`` asks for jemalloc in a run of the ``rlvr`` command: a
    Hugging Face model (``model.path`` set) on the CPU (``train.device = cpu``), gradient
    checkpointing or not. Its learn stage frees large activations around blocks that live on, and
    glibc's best fit then walks them at every later allocation; with checkpointing jemalloc's steps
    were shorter and its peak lower than glibc's defaults (``system``); the built-in tiny model's steps
    are faster under glibc's ``keep`` (docs/benchmarks.md, "Figures behind the code's rules")."""
    return hf_model and device == "cpu"


def set_host_memory(mode: str, checkpointing: bool = False) -> str:
    """Apply ``train.host_memory`` to this process (``checkpointing``: the run's
    ``model.gradient_checkpointing``, which ``auto`` reads); returns a line saying what holds now."""
    took = resolve(mode, checkpointing)
    why = ("train.host_memory = auto with model.gradient_checkpointing: memory goes back between steps"
           if mode == "auto" and checkpointing else "train.host_memory = system")
    if took == "jemalloc":
        why = "; train.host_memory = auto: a Hugging Face model on the CPU" if mode == "auto" else ""
    return _apply(took, why)


def _apply(mode: str, why: str) -> str:
    global _kept
    if mode == "jemalloc":
        lib = _rlvr_preloaded()
        return (f"host memory: jemalloc (preloaded: {lib}{why})" if lib
                else "host memory: the C library's (train.host_memory = jemalloc: rlvr train runs itself again "
                     "with jemalloc preloaded; this process was not started so)")
    outside = _preloaded_from_outside()
    if outside:
        return (f"host memory: {Path(outside).name} (preloaded from outside rlvr, LD_PRELOAD); "
                f"train.host_memory = {mode}'s glibc settings do not reach it")
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


PRELOADED = "RLVR_PRELOADED_ALLOCATOR"
"""Set in the environment of the process ``preload_env`` starts: it is not started again."""


def _mapped(name: str) -> bool:
    """Whether a library of that file name is mapped into this process (/proc/self/maps; False elsewhere)."""
    try:
        return any(line.rstrip().endswith("/" + name) for line in Path("/proc/self/maps").read_text().splitlines())
    except OSError:
        return False


def _rlvr_preloaded() -> str | None:
    """The library ``preload_env`` started this process with (``PRELOADED``), where it is mapped; else None."""
    lib = os.environ.get(PRELOADED, "")
    return lib if lib and _mapped(Path(lib).name) else None


def _preload_list(environ) -> list[str]:
    """The libraries LD_PRELOAD names in ``environ`` (the loader splits it at colons and spaces)."""
    return [p for p in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]


def _allocators_in(environ) -> list[str]:
    """The malloc replacements (``ALLOCATOR_NAMES``) LD_PRELOAD names in ``environ``."""
    return [p for p in _preload_list(environ) if Path(p).name.startswith(ALLOCATOR_NAMES)]


ALLOCATOR_NAMES = ("libjemalloc", "libtcmalloc", "libmimalloc")
"""File-name starts of malloc replacements that serve a process's allocations when preloaded."""


def _preloaded_from_outside() -> str | None:
    """The malloc replacement this process was started with in LD_PRELOAD (a path or name starting
    with one of ``ALLOCATOR_NAMES``, mapped into the process) where rlvr did not preload it; else None."""
    if os.environ.get(PRELOADED):
        return None
    return next((lib for lib in _allocators_in(os.environ) if _mapped(Path(lib).name)), None)


def allocator_library() -> str | None:
    """The jemalloc shared library this machine has: the name the loader finds it by in the system's
    library directories (``ctypes.util.find_library``), else the copy Ray's wheel ships
    (``ray/core/libjemalloc.so``, where Ray is installed); None where neither."""
    name = ctypes.util.find_library("jemalloc")
    if name:
        return name
    import importlib.util

    spec = importlib.util.find_spec("ray")
    lib = Path(spec.origin).parent / "core" / "libjemalloc.so" if spec and spec.origin else None
    return str(lib) if lib is not None and lib.is_file() else None


def preload_env(mode: str, environ: dict[str, str], auto_jemalloc: bool = False) -> dict[str, str] | None:
    """The environment ``rlvr train`` runs itself again with for ``train.host_memory = mode``: with
    jemalloc first in LD_PRELOAD and ``PRELOADED`` set; None where nothing is to change (another
    mode, or this process was started so). ValueError, naming the key, where jemalloc is asked for
    on a system without LD_PRELOAD (not Linux) or none is found. ``auto`` with ``auto_jemalloc``
    (``auto_takes_jemalloc``, in a process the command owns) asks for it where it can be had and
    never fails: not on Linux, with no library found, or with a malloc replacement already
    preloaded from outside, it is None."""
    if environ.get(PRELOADED) or not (mode == "jemalloc" or (mode == "auto" and auto_jemalloc)):
        return None
    linux = platform.system() == "Linux"
    lib = allocator_library() if linux else None
    if mode == "auto" and (lib is None or _allocators_in(environ)):
        return None                                     # auto never fails: glibc's allocator goes on
    if not linux:
        raise ValueError(f"train.host_memory = jemalloc needs Linux (LD_PRELOAD); this is {platform.system()}")
    if lib is None:
        raise ValueError("train.host_memory = jemalloc: no jemalloc library found (install the system's "
                         "libjemalloc2, or Ray: pip install 'rlvr[distributed]'); or set it to auto")
    preload = [lib] + [p for p in _preload_list(environ) if p != lib]
    return {**environ, "LD_PRELOAD": ":".join(preload), PRELOADED: lib}
