import os

import pytest
import torch

# Two cores on CI: keep intra-op threads predictable so timings and determinism hold.
torch.set_num_threads(2)


@pytest.fixture(autouse=True, scope="session")
def quiet_machine():
    """A run warns when the machine is oversubscribed (rlvr.run.set_threads); tests see a quiet
    machine, so what a run writes does not depend on the load of the machine running the tests
    (tests/test_threads.py sets the load it needs). Session-wide, so module-scoped runs see it too."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
        yield
