"""One intra-op thread for these tests: on a shared 2-core machine OpenMP's spinning threads made the many small
DKM kernels up to 40x slower than a single thread (restored after each module)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
