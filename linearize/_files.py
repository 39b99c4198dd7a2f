"""File helpers shared by the package: atomic writes, save locks, safe ``torch.load``, the load error type.

Low in the package (no imports from it), so every module that reads or writes files uses the same
code: :func:`atomic_write` for anything written, :func:`save_lock` around a save into a folder,
:func:`safe_torch_load` for ``.pt`` files a user passes, :class:`LoadError` for a file that cannot be
loaded safely or fails validation.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import secrets
import stat
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["LoadError", "atomic_write", "fsync_path", "remove_stale", "safe_torch_load", "save_lock",
           "SAVE_LOCK_NAME", "TRUST_PICKLE_FLAG"]

TRUST_PICKLE_FLAG = "--trust-pickle"
SAVE_LOCK_NAME = ".linearize.lock"  # in the folder saved into; empty, and left there
SAVE_LOCK_WAIT_S = 600.0  # how long a save waits for another save into the same folder
_TEMP_RE = re.compile(r"\.(.+)\.[0-9a-f]{12}\.tmp")  # temp_name's: .NAME.<12 hex digits>.tmp
_HELD = threading.local()  # .paths: the real paths of the save locks this thread holds


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


@contextmanager
def save_lock(directory: Path) -> Iterator[bool]:
    """Hold the save lock of the existing folder ``directory`` for the body: saves into one folder (from
    several processes, e.g. every DDP rank, or threads) run one at a time, so none removes what another
    is writing.

    The lock is an OS file lock (``filelock``) on the empty file ``directory/.linearize.lock``, which
    stays there; the OS releases it when its holder dies, so a killed save never blocks the next one.
    Loads take no lock (a read-only folder loads): a save commits with one rename, seen whole or not at all.
    Yields True; False to a thread that holds it already (a save made inside another save into that folder,
    from a callback): it goes on under the outer hold, which alone may remove what saves left behind.

    Raises ``PermissionError`` for a folder this process cannot write, ``TimeoutError`` when another save
    has held the lock for ``SAVE_LOCK_WAIT_S`` seconds, and ``OSError`` naming the lock file when it cannot
    be taken (a symbolic link or a folder there, a file system without locks).
    """
    from filelock import FileLock, Timeout

    path = Path(directory) / SAVE_LOCK_NAME
    key, held = os.path.realpath(path), _HELD.__dict__.setdefault("paths", set())
    if key in held:
        yield False
        return
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"{directory}: this process cannot write into the folder (a read-only "
                                            "folder loads, but takes no save): save elsewhere, or fix its permissions")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = stat.S_IFREG
    if not stat.S_ISREG(mode):  # older filelock versions follow a link and truncate its target
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise FileExistsError(f"{path}: the save lock of {directory} is {kind}; a save locks that (empty) file: "
                              "remove what is there and save again")
    lock, wait = FileLock(str(path)), SAVE_LOCK_WAIT_S
    try:
        lock.acquire(timeout=wait)
    except Timeout:
        raise TimeoutError(f"{directory}: another save into this folder has held its lock {path} for {wait:.0f} s "
                           "(a save still running, or a stopped process); let it finish or stop it, then save "
                           "again") from None
    except OSError as err:
        message = (f"{path}: cannot take the save lock of {directory} ({err}); a save needs a writable folder on a "
                   "file system with file locks: save elsewhere, or fix its permissions")
        raise (OSError(err.errno, message) if err.errno is not None else OSError(message)) from err
    held.add(key)
    try:
        yield True
    finally:
        held.discard(key)
        lock.release()


def remove_stale(directory: Path, keep: Collection[str], ours: Callable[[str], bool]) -> None:
    """Remove the files of ``directory`` whose names ``ours`` claims, but those in ``keep``, and the temporary
    files :func:`atomic_write` left for such names (interrupted writes). Only with :func:`save_lock` held: no
    other save is writing them. Best effort: a file held open (by a reader, on Windows) goes next time."""
    for path in directory.iterdir():
        temp = _TEMP_RE.fullmatch(path.name)
        if (path.name not in keep and ours(path.name)) or (temp is not None and ours(temp.group(1))):
            with contextlib.suppress(OSError):
                path.unlink()


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
