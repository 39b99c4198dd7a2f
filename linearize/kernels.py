"""The compiled CPU kernel of the PReLU units (``csrc/prelu.cpp``), built on first use.

:func:`cpu_prelu` returns the kernel's ``prelu(x, w)`` (channels at dim 1, autograd in C++), or
``None`` when it is switched off or cannot be built; :class:`linearize.unit.LinearizableActivation`
then runs the PyTorch-ops path, which computes the same values (``tests/test_unit.py`` compares both).

Build: ``torch.utils.cpp_extension.load`` compiles the source once per machine (about 30 s on two
cores; later processes load the cached library from ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) with ``-O3 -march=native -fno-trapping-math``, so the fused loop
vectorizes with the widest instructions of this CPU, and ``-fopenmp``, so that ``at::parallel_for``
splits it over torch's OpenMP threads (without it the loop runs on one thread while torch's other
OpenMP threads spin, and was slower at 2 threads than at 1). The library name carries a hash of the source,
the CPU's instruction-set flags and the torch version, so a cache shared by different machines never
hands one a library built for another. It needs a C++ compiler and ``ninja`` (a dependency; the
wheel's binary is put on ``PATH`` when no ``ninja`` is there).

Switch: ``LINEARIZE_CPU_KERNEL=0`` uses the PyTorch-ops path without trying to build. A failed build
warns once, with the reason, and falls back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch

__all__ = ["cpu_prelu", "ENV_SWITCH"]

ENV_SWITCH = "LINEARIZE_CPU_KERNEL"
_SOURCE = Path(__file__).parent / "csrc" / "prelu.cpp"
_FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"]
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, object] = {}  # "prelu": the loaded function or None (tried and unavailable)


def _cpu_signature() -> str:
    """The CPU's instruction-set flags (Linux ``/proc/cpuinfo``), or the platform's processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _build() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    key = hashlib.sha1(
        b"\0".join([_SOURCE.read_bytes(), _cpu_signature().encode(), torch.__version__.encode(), " ".join(_FLAGS).encode()])
    ).hexdigest()[:12]
    _log.info("linearize: loading the fused CPU PReLU kernel (compiled on first use per machine, about 30 s)")
    if shutil.which("ninja") is None:  # the ninja wheel's binary, when its venv is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    build_log = logging.getLogger("torch.utils.cpp_extension")
    level = build_log.level
    build_log.setLevel(logging.ERROR)  # it logs "no CUDA runtime found": true, and beside the point here
    try:
        with warnings.catch_warnings():  # deprecation notes of modules the build helper imports
            warnings.simplefilter("ignore")
            from torch.utils.cpp_extension import load

            module = load(name=f"linearize_prelu_{key}", sources=[str(_SOURCE)], extra_cflags=_FLAGS,
                          extra_ldflags=["-fopenmp"], verbose=False)
    finally:
        build_log.setLevel(level)
    return module.prelu


def cpu_prelu() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The compiled ``prelu(x, w)``, or ``None`` (switched off by ``LINEARIZE_CPU_KERNEL=0``, or the build failed)."""
    try:
        return _state["prelu"]  # type: ignore[return-value]
    except KeyError:
        pass
    with _lock:
        if "prelu" not in _state:
            if os.environ.get(ENV_SWITCH, "1") == "0":
                _state["prelu"] = None
            else:
                try:
                    _state["prelu"] = _build()
                except Exception as err:  # no compiler, no ninja, read-only cache...: fall back, loudly
                    warnings.warn(
                        f"linearize: could not build the fused CPU PReLU kernel ({type(err).__name__}: "
                        f"{str(err).strip().splitlines()[-1] if str(err).strip() else err!r}); the units use "
                        f"PyTorch ops instead (same values, slower training steps). Install a C++ compiler "
                        f"to get it, or set {ENV_SWITCH}=0 to silence this.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    _state["prelu"] = None
        return _state["prelu"]  # type: ignore[return-value]
