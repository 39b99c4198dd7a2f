"""File helpers shared by the package: atomic writes, safe ``torch.load``, the load error type.

Low in the package (no imports from it), so every module that reads or writes files uses the same
code: :func:`atomic_write` for anything written, :func:`safe_torch_load` for ``.pt`` files a user
passes, :class:`LoadError` for a file that cannot be loaded safely or fails validation.
"""

from __future__ import annotations

import os
import pickle
import re
import secrets
from pathlib import Path
from typing import Any

__all__ = ["LoadError", "atomic_write", "fsync_path", "safe_torch_load", "TRUST_PICKLE_FLAG"]

TRUST_PICKLE_FLAG = "--trust-pickle"


class LoadError(ValueError):
    """A file could not be loaded: damaged, tampered with, inconsistent, or unsafe to unpickle.

    The message names the file (and the unit or key concerned) and what to do.
    """


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's data, or a directory's entries (a rename into it), to disk; a no-op where
    that cannot be done by path (not POSIX)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: Path) -> Path:
    """A fresh hidden sibling of ``path`` for writing before the rename (``.NAME.<random>.tmp``)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` atomically: readers see the old file or the complete new one.

    The bytes go to a hidden temporary sibling, are flushed to disk, and the temporary file is
    renamed over ``path`` (``os.replace``). If anything fails (disk full, interrupt), the temporary
    file is removed and ``path`` is left as it was. ``str`` data is written as UTF-8. Returns ``path``.
    """
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


def safe_torch_load(path: str | os.PathLike, *, trust_pickle: bool = False, what: str = "") -> Any:
    """``torch.load`` of a file a user passed, on the CPU, without running code from it by default.

    With ``trust_pickle=False`` the file is read with ``weights_only=True`` (tensors, containers
    and plain values only); a file that needs more (a pickled ``nn.Module``, or a crafted pickle)
    raises :class:`LoadError` naming the file and the ``--trust-pickle`` flag, and nothing in it
    runs. ``trust_pickle=True`` unpickles everything: only for files from a trusted source.
    ``what`` (e.g. ``"--checkpoint"``) prefixes messages.
    """
    import torch

    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    if not path.is_file():
        raise FileNotFoundError(f"{label}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except Exception as err:  # a decoder of arbitrary bytes: refusal, truncated zip, garbage, wrong format
        if isinstance(err, pickle.UnpicklingError) and not trust_pickle:
            found = re.search(r"Unsupported (global: GLOBAL \S+|operand \S+)", str(err))
            detail = f" ({found.group(0)})" if found else ""
            raise LoadError(
                f"{label}: refused to unpickle it: it holds Python objects other than tensors{detail}, and "
                "unpickling those runs code from the file. If the file comes from a source you trust (a "
                f"pickled nn.Module you saved yourself), pass {TRUST_PICKLE_FLAG} (trust_pickle=True in "
                "Python); otherwise save a state_dict or use linearize.save_pretrained."
            ) from None
        raise LoadError(f"{label}: could not be loaded ({type(err).__name__}: {err}); is it a complete "
                        "PyTorch file, and (for a pickled module) is its class importable?") from err
