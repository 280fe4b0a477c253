"""torch.compile for model.compile: one compiled code per function, shared by every call in the process.

``compiled_call(name, fn, args, dynamic, eager)`` runs ``torch.compile(fn)(*args)`` with the given
dimensions marked dynamic (one code for every batch and sequence length; other sizes that change
become dynamic after one more compile, torch.compile's automatic dynamic shapes). Where compiling
fails (a CPU needs a C++ compiler for Inductor's kernels; an unsupported torch) the reason is kept,
a warning says it once, ``eager()`` computes the call and every later call runs eagerly
(``compile_available()`` is then False). Users: rlvr.models.lean_llama (the decoder layers) and
rlvr.losses (the token log-probs of a training forward).
"""

from __future__ import annotations

import warnings

import torch

_COMPILED: dict = {}
"""name -> ``torch.compile``'d function (made at first use); "failed" -> why compiling failed here."""


def compile_available() -> bool:
    """Whether ``compiled_call`` compiles: ``torch.compile`` exists and has not failed in this process."""
    return hasattr(torch, "compile") and "failed" not in _COMPILED


def compile_failure() -> str | None:
    """Why compiling failed in this process (``ExceptionType: first line``), or None."""
    return _COMPILED.get("failed")


def compiled_call(name: str, fn, args: tuple, dynamic: tuple[tuple[int, int], ...], eager):
    """``torch.compile(fn)(*args)`` under ``name`` (one compiled function per name), dimension ``dim``
    of each tensor ``args[i]``, (i, dim) in ``dynamic``, marked dynamic. Where compiling has failed
    (now or before in this process) ``eager()`` instead (see the module docstring)."""
    if "failed" in _COMPILED:
        return eager()
    compiled = _COMPILED.get(name)
    if compiled is None:
        compiled = _COMPILED[name] = torch.compile(fn, dynamic=None)
    mark = getattr(torch._dynamo, "maybe_mark_dynamic", None)   # older torch: automatic dynamic shapes only
    for i, dim in dynamic if mark is not None else ():
        mark(args[i], dim)
    try:
        return compiled(*args)
    except Exception as e:  # noqa: BLE001 - any failure to compile leaves the eager code, said once
        first = str(e).splitlines()[0] if str(e) else ""
        _COMPILED["failed"] = f"{type(e).__name__}: {first}"
        warnings.warn(f"model.compile: compiling failed ({_COMPILED['failed']}); the eager code runs instead "
                      f"in this process", RuntimeWarning, stacklevel=2)
        return eager()
