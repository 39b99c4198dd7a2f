"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

# The suite's results must not depend on the machine's core count: at most two intra-op threads, and one
# per pytest-xdist worker (the suite runs on two workers, `-n 2` in pyproject.toml: two workers with two
# threads each would oversubscribe a 2-core machine). Tests of thread counts set their own.
THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads())


# The files that take longest, longest first (the 25 slowest tests of CI's log, `--durations=25`, tell). The
# workers take whole files (`--dist loadfile`) in collection order, so these start first and the short files
# fill in behind them, instead of a long file starting last while the other worker idles.
LONGEST_FIRST = (
    "tests/recipes/test_reproduce_speed.py",  # one test of 6 minutes (CI's log, 2 workers): it starts first
    "tests/test_docs.py",
    "tests/test_zoo.py",
    "tests/recipes/test_recipes.py",
    "tests/recipes/test_recipes_fsdp.py",
    "tests/recipes/test_resume.py",
    "tests/test_fsdp.py",
    "tests/recipes/test_sweeps_resumes_and_loads.py",
    "tests/recipes/test_committed_models.py",
    "tests/test_invariants.py",
    "tests/test_unit_exactness.py",
    "tests/test_data_forms.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files of ``LONGEST_FIRST`` first, in its order; every file's tests keep their order."""
    missing = [path for path in LONGEST_FIRST if not (config.rootpath / path).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: LONGEST_FIRST names {missing}, which do not exist: "
                                "update it to the files' new paths (or drop them)")
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture(scope="session", autouse=True)
def fixed_threads():
    """``THREADS`` intra-op threads for the whole session (modules may ask for one, below)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same random state (torch, random, numpy), whatever ran before it, so
    tests pass alone and in any order; tests that need other draws seed their own generators."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests: small models run far faster on one thread of a shared,
    busy CPU than on two contended ones, and in-process runs then match one-thread subprocesses bit
    for bit. Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has ended (temp folders named for a live pid belong to a running writer)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture(scope="module")
def tiny_cifar(tmp_path_factory):
    """A CIFAR-10 image-folder tree: 2 train and 1 test image of 8x8 random pixels per class."""
    from torchvision.io import write_png

    root = tmp_path_factory.mktemp("cifar")
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 2), ("test", 1)):
        for c in CIFAR10_CLASSES:
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                write_png(torch.randint(0, 256, (3, 8, 8), generator=g, dtype=torch.uint8), str(root / split / c / f"{i}.png"))
    return root


@pytest.fixture
def cli_refusal(capsys):
    """``cli_refusal(argv)``: run the ``linearize`` command line, check that it refused in one line with exit
    status 2 (no traceback), and return that line."""

    def refused(argv: list[str]) -> str:
        from linearize.cli import main

        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"linearize {argv[0]}: error: "), err
        return err

    return refused
