"""File helpers shared by the package: atomic writes, save locks, safe ``torch.load``, the load error type.

Low in the package (no imports from it), so every module that reads or writes files uses the same
code: :func:`atomic_write` for anything written, :func:`save_lock` around a save into a folder,
:func:`safe_torch_load` for ``.pt`` files a user passes, :class:`LoadError` for a file that cannot be
loaded safely or fails validation.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import secrets
import stat
import sys
import threading
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["LoadError", "atomic_write", "fsync_path", "remove_stale", "safe_torch_load", "save_lock", "open_regular",
           "read_regular", "read_file", "check_regular", "parse_json", "read_json", "check_folder", "check_given_folder",
           "flock_error", "SAVE_LOCK_NAME", "TRUST_PICKLE_FLAG", "MAX_JSON_BYTES"]

TRUST_PICKLE_FLAG = "--trust-pickle"
SAVE_LOCK_NAME = ".linearize.lock"  # in the folder saved into; empty, and left there
SAVE_LOCK_WAIT_S = 600.0  # how long a save waits for another save into the same folder
_TEMP_RE = re.compile(r"\.(.+)\.[0-9a-f]{12}\.tmp")  # temp_name's: .NAME.<12 hex digits>.tmp
_HELD = threading.local()  # .paths: the real paths of the save locks this thread holds
_TURNS: dict[str, threading.Lock] = {}  # real path of a save lock: the lock this process's threads take turns on
_TURNS_GUARD = threading.Lock()  # held while an entry of _TURNS is made
MAX_JSON_BYTES = 256 * 2**20  # the largest JSON file (manifest, config, index, metrics) read


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


def open_regular(path: str | os.PathLike, check: Callable[[os.stat_result], int]) -> tuple[BinaryIO, int]:
    """``path`` opened for reading bytes, only after ``check`` passed on its ``stat`` and again on the opened
    file's (it raises, or returns a size), and what ``check`` returned the second time: opened without blocking,
    so a FIFO (or one swapped in) is refused, not waited on. A symbolic link is followed and its target checked.
    The caller bounds what it reads (:func:`read_regular` reads it whole)."""
    check(os.stat(path))  # before opening: opening a socket fails, a plain open of a FIFO waits
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        size = check(os.fstat(fd))
        return os.fdopen(fd, "rb"), size
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, check: Callable[[os.stat_result], int], limit: int) -> bytes:
    """The bytes of ``path``, read only after ``check`` passed on its ``stat`` and again on the opened file's
    (it raises, or returns the size to read; :func:`open_regular`): read at its size plus one byte (no
    ``limit``-sized buffer), and refused with :class:`LoadError` when it grows past ``limit`` while being read."""
    f, size = open_regular(path, check)
    with f:
        data = f.read(size + 1)  # its size and one byte more, to notice growth
        if len(data) > size:  # it grew since it was checked: read on, at most to the limit
            data += f.read(limit + 1 - len(data))
    if len(data) > limit:
        raise LoadError(f"{path} grew past {limit:,} bytes while being read: refusing it")
    return data


def read_file(path: str | os.PathLike, limit: int, what: str = "file") -> bytes:
    """The bytes of the regular file ``path`` of at most ``limit`` bytes (:func:`read_regular`);
    :class:`LoadError` naming it and ``what`` it should be when it is a FIFO, device, socket or folder,
    or larger. ``FileNotFoundError`` when it is missing.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.json"; _ = p.write_bytes(b"{}")
        >>> read_file(p, 10, "manifest")
        b'{}'
    """

    def check(info: os.stat_result) -> int:
        _refuse_irregular(path, info, what)
        if info.st_size > limit:
            raise LoadError(f"{path} is {info.st_size:,} bytes, more than a {what} can be ({limit:,}): refusing to "
                            "read it; put the saved file back, or save again")
        return info.st_size

    return read_regular(path, check, limit)


def _refuse_irregular(path: str | os.PathLike, info: os.stat_result, what: str) -> None:
    """:class:`LoadError` naming ``path`` and ``what`` it should be when ``info`` (its ``stat``) is no regular file."""
    if not stat.S_ISREG(info.st_mode):
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file (a FIFO, device or socket)"
        raise LoadError(f"{path} is {kind}, where a {what} should be: refusing to read it; put the saved file "
                        "back, or save again")


def check_regular(path: str | os.PathLike, what: str = "file") -> None:
    """Check, reading nothing, that ``path`` is a regular file (a symbolic link is followed), before a reader that
    opens it by name: :class:`LoadError` naming it and ``what`` it should be when it is a folder, FIFO, device or
    socket (opening a FIFO would wait for a writer). ``FileNotFoundError`` when it is missing.

    Example:
        >>> import tempfile, pathlib
        >>> check_regular(pathlib.Path(tempfile.mkdtemp()), "weights file")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        linearize._files.LoadError: ... is a folder, where a weights file should be: refusing to read it; ...
    """
    _refuse_irregular(path, os.stat(path), what)


def parse_json(raw: bytes | str, path: str | os.PathLike) -> Any:
    """The JSON value of ``raw`` (the contents of ``path``); :class:`LoadError` naming ``path`` when it is not
    UTF-8 JSON, nests too deep for Python to parse, or holds an integer longer than Python converts.

    Example:
        >>> parse_json(b'{"a": [1]}', "x.json")
        {'a': [1]}
    """
    try:
        return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        problem = "the file is empty" if not raw.strip() else f"not valid JSON ({err})"
    except RecursionError:
        problem = "not valid JSON for this reader: it nests deeper than Python can parse"
    except ValueError:  # Python's limit on converting long digit strings to int
        problem = ("not valid JSON for this reader: it holds an integer of more than "
                   f"{sys.get_int_max_str_digits():,} digits")
    raise LoadError(f"{path}: {problem}; a damaged or partly written file, or not the file it should be")


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """:func:`parse_json` of :func:`read_file` (at most :data:`MAX_JSON_BYTES`): the JSON value of ``path``,
    or :class:`LoadError` naming it (``FileNotFoundError`` when missing).

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.json"; _ = p.write_text("[1, 2]")
        >>> read_json(p)
        [1, 2]
    """
    return parse_json(read_file(path, MAX_JSON_BYTES, what), path)


def check_folder(path: str | os.PathLike, what: str) -> None:
    """Check, creating nothing, that files can be written into the folder ``path``: it is a folder, or the
    nearest of its parents that exists is one (it is created later), and this process may write there.
    ``NotADirectoryError`` naming ``path`` and ``what`` (e.g. ``"--output-dir"``) when it or a parent is a file,
    ``FileNotFoundError`` when it is a symbolic link to nothing, ``OSError`` when it is a loop of links,
    ``PermissionError`` when that folder is read-only; a command calls it before the work whose files go there.

    Example:
        >>> import tempfile, pathlib
        >>> file = pathlib.Path(tempfile.mkdtemp()) / "notes.txt"; _ = file.write_text("")
        >>> check_folder(file.parent / "new" / "report", "report folder")  # created later: fine
        >>> check_folder(file / "report", "report folder")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        NotADirectoryError: report folder .../notes.txt/report is under the file .../notes.txt, ...
    """
    path = Path(path)
    for folder in (path, *path.parents):  # the nearest that exists
        try:
            mode = os.stat(folder).st_mode
        except (FileNotFoundError, NotADirectoryError):  # missing, or under a file (found further up)
            if os.path.islink(folder):  # a link to nothing: it cannot be created as a folder
                raise FileNotFoundError(f"{what} {path}: {folder} is a symbolic link to {os.readlink(folder)}, which "
                                        "does not exist: create the folder it links to, or remove the link") from None
            continue
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise OSError(errno.ELOOP, f"{what} {path}: {folder} is a loop of symbolic links (one leads back to "
                                       "itself): remove the link, or give another folder") from None
        if not stat.S_ISDIR(mode):
            where = "is a file" if folder == path else f"is under the file {folder}"
            raise NotADirectoryError(f"{what} {path} {where}, not a folder: files are written into a folder; give "
                                     "the path of a folder (created when missing), or move the file away")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"{what} {path}: this process cannot write into {folder}: give a folder it "
                                  "can write into, or fix its permissions")
        return


def check_given_folder(path: str | os.PathLike, what: str) -> None:
    """Check that ``path``, given as the folder of ``what`` (e.g. ``"a linearize save"``), is not a file: one of the
    save's files given instead of its folder (``out/linearize_config.json`` for ``out``) raises
    ``NotADirectoryError`` naming it and the fix (pass the folder that holds it). A folder or a missing path passes.

    Example:
        >>> import tempfile, pathlib
        >>> file = pathlib.Path(tempfile.mkdtemp()) / "folded.json"; _ = file.write_text("{}")
        >>> check_given_folder(file, "a folded save")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        NotADirectoryError: .../folded.json is a file, not a folder: a folded save is loaded from its folder; pass ...
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is a file, not a folder: {what} is loaded from its folder; pass the "
                                 f"folder that holds it ({path.parent})")


def temp_name(path: Path) -> Path:
    """A fresh hidden sibling of ``path`` for writing before the rename (``.NAME.<random>.tmp``)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` atomically: readers see the old file or the complete new one.

    The bytes go to a hidden temporary sibling, are flushed to disk, and the temporary file is
    renamed over ``path`` (``os.replace``). If anything fails (disk full, interrupt), the temporary
    file is removed and ``path`` is left as it was. ``str`` data is written as UTF-8. Returns ``path``.
    ``IsADirectoryError`` naming ``path``, before writing, when it is a folder.
    """
    path = Path(path)
    tmp = _write_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


def atomic_write_all(directory: Path, files: Mapping[str, bytes | str],
                     marker: tuple[str, str] | None = None) -> dict[str, Path]:
    """Write the files ``{name: data}`` into the existing folder ``directory`` as one save: every file is first
    written to a hidden temporary sibling and flushed to disk (as by :func:`atomic_write`), and only once all are
    written are they renamed over their names, in order. A failure while writing (disk full, interrupt) removes
    the temporary files and leaves every file of ``directory`` as it was, so it never holds some new files beside
    old ones. Returns ``{name: path}``; ``IsADirectoryError`` naming the path, before writing, where one is a folder.

    The renames are not one step: a process killed between two of them leaves new files beside old ones.
    ``marker`` ``(name, text)``: a file written (atomically) once every temporary file is written, before the first
    rename, and left there for the caller to remove once the save is complete; readers that find it know the folder
    may hold files of two saves.
    """
    temps: dict[Path, Path] = {}
    try:
        for name, data in files.items():
            temps[directory / name] = _write_temp(directory / name, data)
        if marker is not None:
            atomic_write(directory / marker[0], marker[1])
        for path, tmp in list(temps.items()):
            os.replace(tmp, path)
            del temps[path]
    except BaseException:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        raise
    fsync_path(directory)
    return {name: directory / name for name in files}


def _write_temp(path: Path, data: bytes | str) -> Path:
    """Write ``data`` (``str``: as UTF-8) to a fresh :func:`temp_name` of ``path``, flushed to disk; return it.
    A failed write (a full disk, a file-size or quota limit), whose ``OSError`` names no file, is raised as one
    naming ``path`` (same ``errno``) with the fix."""
    if path.is_dir() and not path.is_symlink():  # the rename would fail on it, after the writing
        raise IsADirectoryError(f"{path} is a folder, where a save writes a file: move or remove that folder, "
                                "or save elsewhere")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:
            raise OSError(err.errno, f"{err.strerror or err} (free space on that disk, or save elsewhere; what the "
                                     "folder held before is left as it was)", str(path)) from err
        raise
    return tmp


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

    The threads of this process first take turns on a process-wide lock of the folder, so where the file system
    cannot lock files (:func:`flock_error`: NFS without its lock manager, Lustre without ``-o flock``) they are
    still kept apart; the save goes on without the file lock, with one ``RuntimeWarning`` naming the folder:
    each file is still written whole (atomic renames), but saves from other processes are not kept apart.

    Raises ``PermissionError`` for a folder this process cannot write, ``TimeoutError`` when another save
    has held the lock for ``SAVE_LOCK_WAIT_S`` seconds, and ``OSError`` naming the lock file when it cannot
    be taken (a symbolic link or a folder there).
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
    busy = (f"{directory}: another save into this folder has held its lock {path} for {wait:.0f} s (a save still "
            "running, or a stopped process); let it finish or stop it, then save again")
    with _TURNS_GUARD:
        turn = _TURNS.setdefault(key, threading.Lock())
    if not turn.acquire(timeout=wait):  # another thread of this process is saving into the folder
        raise TimeoutError(busy)
    try:
        try:
            missing = flock_error(path)
            if missing is None:
                lock.acquire(timeout=wait)
        except Timeout:
            raise TimeoutError(busy) from None
        except OSError as err:
            message = (f"{path}: cannot take the save lock of {directory} ({err}); a save needs a writable folder: "
                       "save elsewhere, or fix its permissions")
            raise (OSError(err.errno, message) if err.errno is not None else OSError(message)) from err
        if missing is not None:
            warnings.warn(f"{directory}: this filesystem cannot lock files (flock: {missing.strerror}), so this "
                          "save is kept apart from the other threads of this process saving into the folder, but "
                          "not from other processes (each file is still written whole): save into it from one "
                          "process at a time", RuntimeWarning, stacklevel=4)
        held.add(key)
        try:
            yield True
        finally:
            held.discard(key)
            if missing is None:
                lock.release()
    finally:
        turn.release()


def flock_error(path: str | os.PathLike) -> OSError | None:
    """The error of ``flock`` on the file ``path`` (created) where the file system cannot lock files (ENOLCK,
    ENOSYS, EOPNOTSUPP, ...), else ``None`` (also when another process holds the lock, and where there is no
    ``fcntl``: Windows, where ``filelock`` locks with ``msvcrt``). The probe's own lock is released on return.
    """
    try:
        import fcntl
    except ImportError:
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return err
    finally:
        os.close(fd)  # releases a lock the probe took
    return None


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
    ``what`` (e.g. ``"--checkpoint"``) prefixes messages. A missing path raises ``FileNotFoundError``; a folder,
    FIFO, device or socket :class:`LoadError` saying which (:func:`check_regular`), before anything is opened.
    """
    import torch

    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    if not path.exists():
        raise FileNotFoundError(f"{label}: no such file")
    check_regular(path, f"{what} file (a .pt file saved by torch.save)" if what else "PyTorch file")
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
