"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests: small models run far faster on one thread of a shared,
    busy CPU than on two contended ones, and in-process runs then match one-thread subprocesses bit
    for bit. Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
