import os

# Two cores on CI: keep intra-op threads predictable so timings and determinism hold. Under
# pytest-xdist (`-n N`) each worker process runs on a core of its own (its affinity mask, which the
# runs, subprocesses and local Ray it starts inherit) with one thread: workers never share a core,
# which costs a 2-thread torch process 15-50x when another busy one shares its cores. The mask is
# set before torch is imported: pinned after, a bf16 test at real shapes ran ~30x slower (oneDNN's
# parallel regions still ran two OpenMP threads, then on one core).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_PINNED = _WORKER.startswith("gw") and hasattr(os, "sched_setaffinity")
if _PINNED:
    _cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {_cores[int(_WORKER[2:]) % len(_cores)]})

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1 if _PINNED else 2)

LONGEST_FIRST = ("test_compile.py", "test_distributed.py", "test_real_shapes.py", "test_interrupts.py",
                 "test_fsdp.py", "test_hostmem.py")
"""The test files that take most of the suite's time on a 2-core machine, longest first (in-suite
seconds in docs/benchmarks.md, "The test suite"); they run before every other file. Under
`--dist loadfile --no-loadscope-reorder` pytest-xdist hands whole files to the workers in
collection order, each worker taking the next file as it runs out: with the longest first the two
workers end together (xdist's own order, most tests first, started the compile tests near the end)."""


def pytest_collection_modifyitems(config, items):
    """The files of ``LONGEST_FIRST`` first, in its order; every other in pytest's order (the sort is stable)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True, scope="session")
def quiet_machine():
    """A run warns when the machine is oversubscribed (rlvr.machine.set_threads); tests see a quiet
    machine, so what a run writes does not depend on the load of the machine running the tests
    (tests/test_threads.py sets the load it needs). Session-wide, so module-scoped runs see it too."""
    from rlvr import machine

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(machine, "PROC_STAT", "/nonexistent/proc/stat")   # no direct measurement: the load average below
        mp.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
        yield


@pytest.fixture(autouse=True, scope="session")
def no_native_bf16():
    """`model.autocast = auto` (the default) takes bf16 for models at least AUTOCAST_MIN_HIDDEN wide
    on a device with bf16 units (rlvr.numerics.native_bf16); tests see a machine without them, so what
    a run computes does not depend on the CPU running the tests. The size floor is lifted so that the
    tests' tiny models reach the rule, and a timing (the price of a run set to bf16) reads 1 ms in
    both numerics: tests/test_autocast.py sets what it needs, checks the floor itself, and runs the
    real detection and measurement once."""
    from rlvr import numerics as numerics_mod

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(numerics_mod, "native_bf16", lambda device: False)
        mp.setattr(numerics_mod, "autocast_timings", lambda device, rows, inner, outer, **kw: (1e-3, 1e-3))
        mp.setattr(numerics_mod, "AUTOCAST_MIN_HIDDEN", 0)
        yield


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray (4 logical CPUs, no dashboard, on loopback as a run's own: init_local_ray) for every
    test that asks for it, started at the first and shut down at the end of the session: each start
    costs ~5 s on a 2-core machine. A run that finds Ray running joins it and leaves it up
    (rlvr.distributed.sync.start_ray)."""
    ray = pytest.importorskip("ray")
    started = False
    if not ray.is_initialized():
        from rlvr.distributed.sync import init_local_ray

        init_local_ray(ray, 4)
        started = True
    yield ray
    if started:
        ray.shutdown()
