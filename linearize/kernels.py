"""The compiled CPU kernels of the units (``csrc/prelu.cpp``), built on first use.

:func:`cpu_prelu` returns the library's ``prelu(x, w)`` (the PReLU of ReLU-family units, channels at dim 1)
and :func:`cpu_blend` its ``blend(act, x, w, inner)`` (the blend of smooth units, channels at dim 1 or last, or
one slope per position), both with autograd in C++, or ``None`` when the kernels are switched off or cannot be had;
:class:`linearize.unit.LinearizableActivation` then runs the PyTorch-ops paths, which compute the same
values (``tests/test_unit.py`` and ``tests/test_unit_exactness.py`` compare both).

Build: ``torch.utils.cpp_extension.load`` compiles the source once per environment (about 30 s on two
idle cores, 100 s or more under load) with ``-O3 -march=native -fno-trapping-math``, so the fused loop
vectorizes with the widest instructions of this CPU, and ``-fopenmp``, so that ``at::parallel_for``
splits it over torch's OpenMP threads (without it the loop runs on one thread while torch's other
OpenMP threads spin, and was slower at 2 threads than at 1). It needs a C++ compiler and ``ninja`` (a
dependency; the wheel's binary is put on ``PATH`` when no ``ninja`` is there).

Cache: :func:`build_directory`, ``linearize_prelu_<key>`` under ``TORCH_EXTENSIONS_DIR`` (by default
torch's ``~/.cache/torch_extensions``). The key hashes everything the build command and the library
depend on (:func:`_build_inputs`: the source's bytes, the flags, the CPU's instruction sets, torch's
version and folder, the interpreter, the compiler), and the source is copied into that folder, so
the build never names a checkout's path. Environments that would build differently get different
folders and never rebuild each other's library (torch's own cache is keyed by name only: two venvs
or checkouts rewrote one ``build.ninja`` with their own paths and recompiled in every process);
checkouts and venvs whose build would be the same share one. A finished build leaves a marker
(``linearize-built``, naming the library), and later processes import the library straight from it,
without a lock, ``ninja`` or a compiler.

Lock: one process builds at a time, holding ``linearize.lock`` in the build folder, an OS file lock
(``filelock``) that the OS releases when its holder dies, so an interrupted build never leaves a
lock that blocks; the holder's pid, host and start time are in ``linearize.lock.owner``. Others wait
for it at most ``LINEARIZE_CPU_KERNEL_WAIT`` seconds (default 300, more than a build takes on a
loaded machine), saying so when they start waiting; past that they warn, naming the lock, its holder
and the fixes, and use the PyTorch ops. Torch's own lock file in the folder (``lock``: before torch
used an OS lock it waited forever on one left by an interrupted build) is removed before building.

Progress: a build says so on stderr when it starts and when it ends (with its time), once per
process (the first run of ``linearize demo`` would otherwise print nothing for minutes); waiting for
another process's build is a logged warning.

Switch: ``LINEARIZE_CPU_KERNEL=0`` uses the PyTorch-ops path without trying to build. A failed build
warns once per process, with the compiler's message and a log file, and falls back.

Not built at install time: a setuptools extension would compile against the torch of pip's isolated
build environment (a second multi-GB torch download, possibly another version than the one it runs
with) for ``-march=native`` of the installing machine, and machines without a compiler would still
need this path. To build ahead of first use (in an image or a CI setup step), call :func:`cpu_prelu`
once, e.g. ``python -c "import linearize.kernels as k; k.cpu_prelu()"``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import os
import platform
import re
import shutil
import socket
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

__all__ = ["cpu_prelu", "cpu_blend", "build_directory", "ENV_SWITCH", "ENV_WAIT"]

ENV_SWITCH = "LINEARIZE_CPU_KERNEL"
ENV_WAIT = "LINEARIZE_CPU_KERNEL_WAIT"
DEFAULT_WAIT_S = 300.0
_SOURCE = Path(__file__).parent / "csrc" / "prelu.cpp"
_FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
_LOCK_NAME = "linearize.lock"
_BUILT_NAME = "linearize-built"  # written after a successful build: the library's file name
_ERROR_LOG_NAME = "build-error.log"
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, object] = {}  # "prelu", "blend": the loaded functions or None (tried and unavailable)
_FUNCTIONS = ("prelu", "blend")

PReLU = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Blend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


class KernelUnavailable(RuntimeError):
    """The kernel cannot be had in this process; the message says why and what to do."""


def _cpu_signature() -> str:
    """The CPU's instruction-set flags (Linux ``/proc/cpuinfo``), or the platform's processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _build_inputs() -> dict[str, str]:
    """What the build command and the compiled library depend on, each as text (hashed into the key).

    Two environments whose build commands would differ (another torch install, interpreter or compiler:
    torch's build names their paths) must not share a folder, or each would rebuild the other's library.
    """
    cxx = os.environ.get("CXX", "c++")  # what torch's build runs
    found = shutil.which(cxx)
    return {
        "source": hashlib.sha256(_SOURCE.read_bytes()).hexdigest(),
        "flags": " ".join(_FLAGS) + " | " + " ".join(_LDFLAGS),
        "cpu": _cpu_signature(),
        "torch": f"{torch.__version__} {os.path.realpath(os.path.dirname(torch.__file__))}",
        "python": f"{sys.version} {getattr(sys, 'abiflags', '')} {sysconfig.get_paths()['include']}",
        "compiler": f"{cxx} {os.path.realpath(found) if found else '(not found)'}",
    }


@contextmanager
def _quiet_cpp_extension() -> Iterator[ModuleType]:
    """``torch.utils.cpp_extension``, its logger muted below errors while in the block.

    It logs "no CUDA runtime found" on import and at builds: true, and beside the point for a CPU
    kernel; its import also raises deprecation notes of the modules it imports.
    """
    build_log = logging.getLogger("torch.utils.cpp_extension")
    level = build_log.level
    build_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.utils import cpp_extension
        yield cpp_extension
    finally:
        build_log.setLevel(level)


def build_directory() -> Path:
    """This environment's build folder of the kernel: ``linearize_prelu_<key>`` under ``TORCH_EXTENSIONS_DIR``."""
    key = hashlib.sha256(repr(sorted(_build_inputs().items())).encode()).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        with _quiet_cpp_extension() as cpp_extension:
            root = cpp_extension.get_default_build_root()
    return Path(root) / f"linearize_prelu_{key}"


def _wait_bound() -> float:
    """Seconds to wait for another process's build: ``LINEARIZE_CPU_KERNEL_WAIT``, default 300."""
    value = os.environ.get(ENV_WAIT, "")
    try:
        seconds = float(value) if value.strip() else DEFAULT_WAIT_S
    except ValueError:
        seconds = math.nan
    if not seconds >= 0:  # NaN or negative: filelock would wait forever (a negative timeout blocks)
        raise KernelUnavailable(f"linearize: {ENV_WAIT}={value!r} is not a number of seconds >= 0")
    return seconds


def _holder(owner: Path) -> str:
    """Who holds the build lock, from its ``.owner`` file: pid, host, for how long, whether it still runs."""
    try:
        pid_text, host, since = owner.read_text().split()[:3]
        pid = int(pid_text)
        held = f"process {pid} on {host} (holding it for {time.time() - float(since):.0f} s"
    except (OSError, ValueError):
        return "another process (its pid is not recorded yet)"
    if host != socket.gethostname():
        return held + ")"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return held + ", no longer running)"
    except OSError:
        pass
    return held + ", still running)"


@contextmanager
def _build_lock(path: Path, timeout: float) -> Iterator[None]:
    """Hold the OS file lock ``path``, waiting at most ``timeout`` s; else raise :class:`KernelUnavailable`.

    The OS releases the lock when its holder dies, so only a live process (a build in progress, or a
    stopped or hung one) is ever waited for. The holder's pid, host and start time go to ``path.owner``.
    """
    from filelock import FileLock, Timeout

    lock = FileLock(str(path))
    owner = path.with_name(path.name + ".owner")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _log.warning("linearize: %s is building the fused CPU PReLU kernel; waiting for it at most %.0f s "
                     "(lock %s)", _holder(owner), timeout, path)
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise KernelUnavailable(
                f"linearize: waited {timeout:.0f} s for the lock {path} of the fused CPU PReLU kernel's build, "
                f"held by {_holder(owner)}: a build still in progress, or a stopped or hung one. The units use "
                f"PyTorch ops instead (same values, slower training steps). If no build is running, stop that "
                f"process or delete {path}; set {ENV_WAIT}=<seconds> to wait longer, or {ENV_SWITCH}=0 to skip "
                f"the kernel."
            ) from None
    try:
        owner.write_text(f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n")
        yield
    finally:
        owner.unlink(missing_ok=True)
        lock.release()


def _import_library(path: Path) -> ModuleType:
    """Import the compiled extension module at ``path`` (its module name is the file name's stem)."""
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    if spec is None or spec.loader is None:
        raise ImportError(f"not an extension module: {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_built(directory: Path) -> ModuleType | None:
    """The library of a finished build in ``directory``, or ``None`` (not built, or it does not load)."""
    try:
        return _import_library(directory / (directory / _BUILT_NAME).read_text().strip())
    except FileNotFoundError:
        return None
    except (OSError, ImportError) as err:
        _log.info("linearize: rebuilding the kernel in %s: its library did not load (%s)", directory, err)
        return None


def _compile(directory: Path) -> ModuleType:
    """Build the kernel in ``directory`` (the build lock held) with torch's ninja build, and import it."""
    source = directory / _SOURCE.name
    code = _SOURCE.read_bytes()
    if not source.is_file() or source.read_bytes() != code:
        source.write_bytes(code)  # builds name this copy, never a checkout's path
    (directory / "lock").unlink(missing_ok=True)  # torch's, left by an interrupted build: no one else builds here
    if shutil.which("ninja") is None:  # the ninja wheel's binary, when its venv is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    with _quiet_cpp_extension() as cpp_extension:
        return cpp_extension.load(name=directory.name, sources=[str(source)], build_directory=str(directory),
                                  extra_cflags=list(_FLAGS), extra_ldflags=list(_LDFLAGS),  # torch appends to these
                                  verbose=False)


def _reason(err: BaseException) -> str:
    """The telling line of a build error (the compiler's ``error:`` or ``not found``, not ninja's last words)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    telling = [line for line in lines if re.search(r"error|not found|no such file|cannot", line, re.IGNORECASE)
               and not line.startswith(("ninja:", "Error building extension"))]
    line = (telling or lines or [repr(err)])[0]
    return f"{type(err).__name__}: {line[:300]}"


def _failure_message(err: BaseException, log: Path | None = None) -> str:
    """The warning for a failed build: the reason, where the full output is, the fixes."""
    where = f"; full output in {log}" if log is not None else ""
    return (f"linearize: could not build the fused CPU PReLU kernel ({_reason(err)}{where}); the units use "
            f"PyTorch ops instead (same values, slower training steps). Install a C++ compiler (or point CXX at "
            f"one) to get it, or set {ENV_SWITCH}=0 to silence this.")


def _announce(line: str) -> None:
    """Say ``line`` on stderr (a first build takes minutes: a run must not sit silent) and in the log."""
    print(line, file=sys.stderr, flush=True)
    _log.info(line)


def _build() -> ModuleType:
    """The kernels' library: from this environment's finished build, else built now under the lock."""
    directory = build_directory()
    module = _load_built(directory)
    if module is None:
        directory.mkdir(parents=True, exist_ok=True)
        with _build_lock(directory / _LOCK_NAME, _wait_bound()):
            module = _load_built(directory)  # built by the process we waited for
            if module is None:
                _announce(f"linearize: compiling the fused CPU PReLU kernel in {directory} (once per "
                          f"environment; 30 s or more, longer on a loaded machine)...")
                started = time.perf_counter()
                try:
                    module = _compile(directory)
                except Exception as err:
                    log: Path | None = directory / _ERROR_LOG_NAME
                    try:
                        log.write_text(str(err))
                    except OSError:
                        log = None
                    _announce(f"linearize: the kernel's build failed after {time.perf_counter() - started:.0f} s")
                    raise KernelUnavailable(_failure_message(err, log)) from err
                _announce(f"linearize: kernel compiled in {time.perf_counter() - started:.0f} s "
                          f"(later runs load it from {directory})")
                marker = directory / f"{_BUILT_NAME}.{os.getpid()}"
                marker.write_text(Path(module.__file__).name)  # torch may name it ..._v1 (a rebuild in-process)
                os.replace(marker, directory / _BUILT_NAME)
    return module


def _kernel(name: str) -> Callable | None:
    """The library's function ``name``, or ``None`` (switched off by ``LINEARIZE_CPU_KERNEL=0``, or unavailable).

    The first call loads (or builds) the library once for all its functions; a failed build warns once.
    """
    try:
        return _state[name]  # type: ignore[return-value]
    except KeyError:
        pass
    with _lock:
        if name not in _state:
            module = None
            if os.environ.get(ENV_SWITCH, "1") != "0":
                try:
                    module = _build()
                except Exception as err:  # no compiler, a lock held too long, read-only cache...: fall back, loudly
                    message = str(err) if isinstance(err, KernelUnavailable) else _failure_message(err)
                    warnings.warn(message, RuntimeWarning, stacklevel=4)
            for function in _FUNCTIONS:  # functions already set (or set by a test) stay
                _state.setdefault(function, getattr(module, function, None))
        return _state[name]  # type: ignore[return-value]


def cpu_prelu() -> PReLU | None:
    """The compiled ``prelu(x, w)``, or ``None`` (switched off by ``LINEARIZE_CPU_KERNEL=0``, or unavailable)."""
    return _kernel("prelu")


def cpu_blend() -> Blend | None:
    """The compiled ``blend(act, x, w, inner)``: ``(1 - w) * act + w * x`` with slopes ``w [C]``, each for ``inner``
    consecutive elements of ``x`` in rows of ``C * inner`` (channels at dim 1: ``inner = prod(x.shape[2:])``;
    channels last, or one slope per position of a map: 1), ``act`` where ``w`` is 0 and ``x`` where it is 1,
    exactly; where every slope is 0 the activation's gradient is the output's own. Or ``None`` (switched off, or
    unavailable)."""
    return _kernel("blend")
