import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def rng(request):
    """A fresh seed per test (MSAIDX_TEST_SEED=N repeats one), printed so a failure replays."""
    seed = int(os.environ.get("MSAIDX_TEST_SEED") or np.random.SeedSequence().entropy % 2**63)
    print(f"{request.node.name}: MSAIDX_TEST_SEED={seed}")
    return np.random.default_rng(seed)
