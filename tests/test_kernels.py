"""The compiled kernel's build: a cache keyed per environment, a bounded wait on its lock, loud fallbacks.

All but the last test fake or fail the compile, so they take seconds; the last one loads the kernel
that ``tests/test_unit.py`` needs anyway (one compile per session and environment).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import torch.utils.cpp_extension

import linearize
from linearize import LinearizableActivation, kernels

REPO = Path(__file__).resolve().parents[1]
needs_flock = pytest.mark.skipif(sys.platform == "win32", reason="the lock holder here uses fcntl.flock")


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh extensions folder, the kernel switched on and not tried yet in this process (restored after)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.delenv(kernels.ENV_SWITCH, raising=False)
    monkeypatch.delenv(kernels.ENV_WAIT, raising=False)
    monkeypatch.setattr(kernels, "_state", {})  # this process's kernel, untouched by the fakes here
    return tmp_path


def _first_forwards(timeout: float) -> tuple[list[torch.Tensor], torch.Tensor, list[warnings.WarningMessage], float]:
    """Two forwards of a fresh unit (the first one gets the kernel) in a thread that may not outlive ``timeout``.

    Returns both outputs, the PReLU formula's values in float64 (the truth), the warnings raised and
    the seconds taken.
    """
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    unit = LinearizableActivation("relu", 3).double()
    with torch.no_grad():
        unit.slope.copy_(torch.tensor([0.0, 0.3, 1.0]))
    truth = torch.where(x > 0, x, unit.slope.detach().view(1, 3, 1, 1) * x)
    result: dict[str, object] = {}

    def run() -> None:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            result["outputs"] = [unit(x), unit(x)]
        result["warnings"] = caught

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    seconds = time.monotonic() - start
    assert not thread.is_alive(), f"the first forward still waits after {timeout} s"
    assert "outputs" in result, "the first forward raised (see the thread's traceback above)"
    return result["outputs"], truth, result["warnings"], seconds  # type: ignore[return-value]


def _hold_lock(path: Path) -> subprocess.Popen:
    """Another process holding the OS lock on ``path`` (as a build in progress does) until it is killed."""
    code = ("import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "time.sleep(300)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def _fake_build(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Replace torch's compile by a fake that records its calls and returns PyTorch's ``F.prelu`` as the kernel.

    Like torch before it used an OS lock, the fake refuses to build while torch's lock file is there
    (torch waited forever on it). Imports of a finished build are recorded too (``kind`` "import").
    """
    calls: list[dict] = []

    def load(name: str, sources: list[str], build_directory: str, **kwargs: object) -> SimpleNamespace:
        assert not (Path(build_directory) / "lock").exists(), "torch with FileBaton would wait forever on this lock"
        library = Path(build_directory) / f"{name}.so"
        library.write_bytes(b"")
        calls.append({"kind": "build", "directory": Path(build_directory), "sources": sources})
        return SimpleNamespace(prelu=F.prelu, __file__=str(library))

    def import_library(path: Path) -> SimpleNamespace:
        calls.append({"kind": "import", "directory": path.parent})
        return SimpleNamespace(prelu=F.prelu)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.setattr(kernels, "_import_library", import_library)
    return calls


def test_each_environment_builds_once_and_checkouts_share_one_build(fresh, monkeypatch):
    """Processes of different environments, alternating on one extensions folder: each environment
    builds once and then loads; a second checkout of the same source shares the first one's build
    (before, all of them shared one folder and each process rebuilt it)."""
    calls = _fake_build(monkeypatch)
    checkout = fresh / "checkout-b" / "csrc" / "prelu.cpp"
    checkout.parent.mkdir(parents=True)
    shutil.copy(kernels._SOURCE, checkout)
    environments = {
        "checkout A": {},
        "checkout B": {"source": checkout},
        "a venv with its own torch": {"torch": "/elsewhere/venv/lib/python3.11/site-packages/torch/__init__.py"},
        "another compiler": {"CXX": "g++"},
    }

    def process(env: dict) -> Path:
        """One process of ``env``: the kernel is looked up anew."""
        with monkeypatch.context() as m:
            m.delitem(kernels._state, "prelu", raising=False)
            if "source" in env:
                m.setattr(kernels, "_SOURCE", env["source"])
            if "torch" in env:
                m.setattr(torch, "__file__", env["torch"])
            if "CXX" in env:
                m.setenv("CXX", env["CXX"])
            assert kernels.cpu_prelu() is F.prelu
            return kernels.build_directory()

    first = [process(env) for env in environments.values()]
    second = [process(env) for env in environments.values()]
    assert second == first
    a, b, own_torch, compiler = first
    assert a == b and len({a, own_torch, compiler}) == 3
    builds = [c for c in calls if c["kind"] == "build"]
    assert [c["directory"] for c in builds] == [a, own_torch, compiler]  # once each, never again
    assert [c["directory"] for c in calls if c["kind"] == "import"] == [b, a, b, own_torch, compiler]
    for c in builds:  # the build names its own copy of the source, not a checkout's path
        assert [Path(s).parent for s in c["sources"]] == [c["directory"]]
        assert Path(c["sources"][0]).read_bytes() == kernels._SOURCE.read_bytes()


@needs_flock
def test_a_held_build_lock_is_waited_for_within_the_bound_then_the_ops_path_runs(fresh, monkeypatch, caplog):
    """A build lock that stays held (a stopped or hung build) makes the first forward wait at most
    LINEARIZE_CPU_KERNEL_WAIT s, say so, then warn once naming the lock, its holder and the fixes, and
    compute the right values with PyTorch ops (before: no bound, no word)."""
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *a, **k: pytest.fail("built despite the lock"))
    monkeypatch.setenv(kernels.ENV_WAIT, "2")
    directory = kernels.build_directory()
    directory.mkdir(parents=True)
    lock = directory / "linearize.lock"
    holder = _hold_lock(lock)
    try:
        (directory / "linearize.lock.owner").write_text(f"{holder.pid} {socket.gethostname()} {time.time() - 900}\n")
        with caplog.at_level("WARNING", logger=kernels.__name__):
            outputs, truth, caught, seconds = _first_forwards(timeout=60)
    finally:
        holder.kill()
        holder.wait()
    assert 2 <= seconds < 15
    assert f"process {holder.pid} on {socket.gethostname()} (holding it for 90" in caplog.text
    assert "is building the fused CPU PReLU kernel; waiting for it at most 2 s" in caplog.text
    [warning] = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    message = str(warning.message)
    assert f"waited 2 s for the lock {lock}" in message
    assert f"process {holder.pid} on {socket.gethostname()} (holding it for 90" in message
    assert "still running): a build still in progress, or a stopped or hung one" in message
    assert f"delete {lock}" in message and "LINEARIZE_CPU_KERNEL=0" in message and "LINEARIZE_CPU_KERNEL_WAIT" in message
    for out in outputs:
        assert torch.equal(out, truth)


@needs_flock
def test_locks_left_by_an_interrupted_build_do_not_block(fresh, monkeypatch, caplog):
    """A builder killed while holding the lock leaves the lock file, its owner record and torch's own
    lock file; the next process builds at once (the OS released the lock, and torch's stale lock file,
    which torch waited on forever while it used FileBaton, is removed)."""
    calls = _fake_build(monkeypatch)
    directory = kernels.build_directory()
    directory.mkdir(parents=True)
    holder = _hold_lock(directory / "linearize.lock")
    (directory / "linearize.lock.owner").write_text(f"{holder.pid} {socket.gethostname()} {time.time()}\n")
    (directory / "lock").touch()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with caplog.at_level("WARNING", logger=kernels.__name__):
        outputs, truth, caught, seconds = _first_forwards(timeout=60)
    assert seconds < 10 and "waiting for it" not in caplog.text
    assert [c["kind"] for c in calls] == ["build"] and not [w for w in caught if w.category is RuntimeWarning]
    for out in outputs:
        assert torch.equal(out, truth)


def test_a_failed_build_warns_once_with_the_compilers_message_and_falls_back(fresh, monkeypatch):
    """No compiler (CXX names none): one warning naming the missing compiler (not ninja's last line,
    "build stopped: subcommand failed", as before), a log of the full output and the switch; the
    units compute the right values with PyTorch ops."""
    monkeypatch.setenv("CXX", str(fresh / "no-such-compiler" / "c++"))
    outputs, truth, caught, seconds = _first_forwards(timeout=120)
    [warning] = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    message = str(warning.message)
    assert "no-such-compiler/c++: not found" in message and "LINEARIZE_CPU_KERNEL=0" in message
    log = kernels.build_directory() / "build-error.log"
    assert f"full output in {log}" in message and "FAILED" in log.read_text()
    assert not (kernels.build_directory() / "linearize-built").exists()  # the next process tries again
    for out in outputs:
        assert torch.equal(out, truth)


def test_a_second_checkout_loads_the_built_kernel_without_compiling(tmp_path):
    """A copy of the package elsewhere (another checkout) in a new process loads this environment's
    build as it is: no file of the build folder is rewritten (before, it recompiled: 103 s here)."""
    if os.environ.get(kernels.ENV_SWITCH) == "0":
        pytest.skip(f"the compiled kernel is switched off ({kernels.ENV_SWITCH}=0)")
    assert kernels.cpu_prelu() is not None, "the kernel did not build: see the RuntimeWarning for why"
    directory = kernels.build_directory()
    before = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    shutil.copytree(REPO / "linearize", tmp_path / "linearize", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import time, torch\n"
            "from linearize import kernels\n"
            "start = time.perf_counter()\n"
            "fn = kernels.cpu_prelu()\n"
            "x, w = torch.randn(3, 2, 4, dtype=torch.float64), torch.tensor([0.25, 0.5], dtype=torch.float64)\n"
            "ok = torch.equal(fn(x, w), torch.where(x > 0, x, w.view(1, 2, 1) * x))\n"
            "print(kernels.__file__, kernels.build_directory(), ok, time.perf_counter() - start)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    module, built_in, ok, seconds = proc.stdout.split()
    assert Path(module).is_relative_to(tmp_path) and built_in == str(directory) and ok == "True"
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == before
    assert float(seconds) < 30


def test_a_first_build_says_so_on_stderr_once_with_its_time(fresh, monkeypatch, capfd):
    """The first use compiles for minutes: one line on stderr when the build starts and one when it
    ends (with the seconds), even with logging unconfigured; later uses and later processes that load
    the finished build print nothing (before, the build said so only through ``logging.info``)."""
    calls = _fake_build(monkeypatch)
    capfd.readouterr()
    assert kernels.cpu_prelu() is F.prelu
    assert kernels.cpu_prelu() is F.prelu  # this process has it: nothing more
    out, err = capfd.readouterr()
    lines = err.splitlines()
    assert out == ""
    assert [c["kind"] for c in calls] == ["build"]
    assert len(lines) == 2, err
    assert "compiling" in lines[0] and str(kernels.build_directory()) in lines[0]
    assert re.search(r"compiled in \d+ s", lines[1]), lines[1]
    monkeypatch.delitem(kernels._state, "prelu")  # a later process: loads the finished build silently
    assert kernels.cpu_prelu() is F.prelu
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("value", ["nan", "-1", "-inf", "soon"])
def test_kernel_wait_bound_refuses_values_that_wait_forever(monkeypatch, value):
    """filelock waits forever for a negative timeout and never times out for NaN: such a
    LINEARIZE_CPU_KERNEL_WAIT must be refused (the units then use PyTorch ops), not obeyed."""
    import linearize.kernels as kernels

    monkeypatch.setenv(kernels.ENV_WAIT, value)
    with pytest.raises(kernels.KernelUnavailable, match="LINEARIZE_CPU_KERNEL_WAIT"):
        kernels._wait_bound()


def test_kernel_wait_bound_accepts_plain_seconds(monkeypatch):
    import linearize.kernels as kernels

    for value, seconds in (("0", 0.0), ("2.5", 2.5), ("", kernels.DEFAULT_WAIT_S)):
        monkeypatch.setenv(kernels.ENV_WAIT, value)
        assert kernels._wait_bound() == seconds


@pytest.mark.parametrize("act", [torch.nn.ReLU(), torch.nn.GELU()], ids=["relu", "gelu"])
def test_batched_backward_through_the_kernel_gives_the_exact_jacobian(act):
    """jacobian(vectorize=True) and grad(is_grads_batched=True) vmap the backward only: the kernel's backward got
    BatchedTensors, which have no storage ("Cannot access data pointer of Tensor that doesn't have storage"). It
    takes them with ATen ops: the Jacobians over the input and the slopes are those of the blend's formula."""
    if os.environ.get(kernels.ENV_SWITCH) == "0":
        pytest.skip(f"the compiled kernel is switched off ({kernels.ENV_SWITCH}=0)")
    assert kernels.cpu_prelu() is not None and kernels.cpu_blend() is not None, "the kernels did not build"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 2, 2, generator=gen, dtype=torch.float64)
    unit = LinearizableActivation(act, 4).double()
    with torch.no_grad():
        unit.slope.copy_(torch.tensor([0.0, 0.3, 0.7, 1.0]))

    def formula(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        a = a.view(1, -1, 1, 1)
        return (1 - a) * act(x) + a * x

    want_x, want_a = torch.autograd.functional.jacobian(formula, (x, unit.slope.detach()))
    got_x = torch.autograd.functional.jacobian(unit, x, vectorize=True)
    xr = x.clone().requires_grad_()
    y = unit(xr)
    basis = torch.eye(y.numel(), dtype=y.dtype).view(-1, *y.shape)
    batched_x, batched_a = torch.autograd.grad(y, (xr, unit.slope), basis, is_grads_batched=True)
    for got, want in ((got_x, want_x), (batched_x.view(want_x.shape), want_x), (batched_a.view(want_a.shape), want_a)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("act", [torch.nn.ReLU(), torch.nn.GELU()], ids=["relu", "gelu"])
def test_fake_tensors_run_through_units_as_through_the_original_with_the_kernel_on(act):
    """Under FakeTensorMode (shape-only forwards: torch.export, compile tracing, memory estimators) the kernel read
    FakeTensors' data ("data is not allocated yet"). Units take the PyTorch ops there, as for FakeTensors passed
    outside the mode. Truth: the unconverted model's fake outputs and input gradients (shapes, dtypes)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    if os.environ.get(kernels.ENV_SWITCH) == "0":
        pytest.skip(f"the compiled kernel is switched off ({kernels.ENV_SWITCH}=0)")
    assert kernels.cpu_prelu() is not None and kernels.cpu_blend() is not None, "the kernels did not build"
    torch.manual_seed(0)
    original = torch.nn.Sequential(torch.nn.Linear(4, 6), act, torch.nn.Linear(6, 2))
    converted = linearize.convert(copy.deepcopy(original), example_inputs=torch.randn(2, 4))
    with torch.no_grad():
        linearize.units(converted)[0][1].slope.fill_(0.5)
    results = []
    for model in (original, converted):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            x = torch.randn(3, 4, requires_grad=True)
            y = model(x)
            y.sum().backward()
        z = model(mode.from_tensor(torch.randn(5, 4)))  # fake tensors outside their mode
        assert all(isinstance(t, FakeTensor) for t in (y, x.grad, z))
        results.append([(t.shape, t.dtype) for t in (y, x.grad, z)])
    assert results[1] == results[0]
