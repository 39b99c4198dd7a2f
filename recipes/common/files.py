"""Files and folders written whole: the sha256 of a file, and :func:`replaced_dir`, which replaces a folder
atomically (temp sibling ``.tmp-<name>-<pid>-<random>``, renamed into place; :func:`restore_aside` repairs a
replacement killed between its two renames); :func:`writing`, which names the file of a failed write; and
:func:`hold_output_dir`, the lock of the run training into an ``OUTPUT_DIR``."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import re
import secrets
import shutil
import socket
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from linearize._files import atomic_write, flock_error, fsync_path


TMP_PREFIX = ".tmp-"
RUN_LOCK = ".run.lock"  # OUTPUT_DIR/.run.lock: held by the run training into OUTPUT_DIR
RUN_OWNER = ".run.owner"  # OUTPUT_DIR/.run.owner: which process holds it (pid, host, command)
_HELD_RUNS: dict[str, object] = {}  # the run locks this process holds, by the lock file's real path
_OWN_TEMPS: set[Path] = set()  # the temp folders of replaced_dir calls running in this process now


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def follow_umask(folder: Path) -> None:
    """Give every file under ``folder`` (a save being written) the mode ``open()`` gives a new file (``0o666``
    less the process umask): safetensors' ``save_file`` (and transformers' ``save_pretrained`` through it) creates
    its file owner-only, which would leave the weights unreadable to whoever may read the files beside them."""
    mask = os.umask(0o077)  # read by setting it (Python has no getter); owner-only meanwhile, never looser
    os.umask(mask)
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, 0o666 & ~mask)


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """The body writes the file or folder ``path``: a failure that names no file (a full disk or a file-size
    limit: Python's ``OSError`` without a file name, ``torch.save``'s ``RuntimeError`` "basic_ios::clear: iostream
    error", safetensors' ``SafetensorError``) is raised as an ``OSError`` (same ``errno`` where known) naming
    ``path``, the likely cause and the fix. Errors that name their file already pass unchanged."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as err:
        if isinstance(err, OSError) and err.filename is not None:
            raise
        message = (f"{path}: writing it failed ({type(err).__name__}: {err}); is the disk full, or a file-size or "
                   "quota limit reached? free space on that disk, or give another --output_dir (the run's earlier "
                   "checkpoints and outputs are left as they were)")
        code = err.errno if isinstance(err, OSError) else None
        raise (OSError(code, message) if code is not None else OSError(message)) from err


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (signal 0 probes without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0
    return True


def hold_output_dir(output_dir: str | Path) -> None:
    """Take the run lock of the folder ``output_dir`` (the main process of a run, before anything else;
    :func:`release_output_dir` at the run's end), so that a second run into the same folder while this one
    trains (the same command launched twice, a requeued job whose first instance still runs) is refused at
    its start instead of deleting the checkpoint this run is writing and mixing the two runs' outputs.

    The lock is an OS file lock (``filelock``) on ``output_dir/.run.lock``, released by the OS when its
    holder dies: a killed run never blocks the next one; ``.run.owner`` names the holder for the other
    run's message. Where the filesystem cannot lock (``flock`` fails: NFS without its lock manager, Lustre
    without ``-o flock``) the run goes on unlocked with a ``RuntimeWarning`` naming the folder. Raises
    ``RuntimeError`` naming the folder, the other process and the fix."""
    from filelock import FileLock, Timeout

    directory = Path(output_dir)
    path = directory / RUN_LOCK
    directory.mkdir(parents=True, exist_ok=True)
    missing = flock_error(path)
    if missing is not None:
        warnings.warn(f"{directory}: this filesystem cannot lock files (flock: {missing.strerror}), so this run is "
                      "not protected against a second run into the same --output_dir: start only one run there "
                      "at a time", RuntimeWarning, stacklevel=2)
        return
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            owner = (directory / RUN_OWNER).read_text(errors="replace").strip()
        except OSError:
            owner = "a process that has not written its name yet"
        raise RuntimeError(f"{directory}: another run is training into this --output_dir ({owner}; it holds the "
                           f"lock {path}); a second run there would delete the checkpoint it is writing and mix "
                           "the two runs' outputs: wait for it to end (or stop it), or give this run another "
                           "--output_dir; if that process has ended (on another host: check there), remove "
                           f"{path} and {directory / RUN_OWNER} and start again") from None
    _HELD_RUNS[os.path.realpath(path)] = lock
    atomic_write(directory / RUN_OWNER, f"process {os.getpid()} on {socket.gethostname()}: "
                                        f"{' '.join([sys.executable, *sys.argv])}\n")


def release_output_dir(output_dir: str | Path) -> None:
    """Release the run lock that :func:`hold_output_dir` took on ``output_dir`` in this process (nothing
    when it holds none: a process other than the main one)."""
    lock = _HELD_RUNS.pop(os.path.realpath(Path(output_dir) / RUN_LOCK), None)
    if lock is not None:
        (Path(output_dir) / RUN_OWNER).unlink(missing_ok=True)
        lock.release()


def _temp_siblings(directory: Path, old: bool | None) -> list[Path]:
    """The temp folders that killed runs of :func:`replaced_dir` left for ``directory``:
    ``.tmp-<name>-<pid>-<random>`` (stages) and ``.tmp-<name>-old-<pid>-<random>`` (old folders set aside;
    also the names without ``-<random>`` of earlier versions); ``old`` picks one kind (None: both). Exact
    names only (``.tmp-model-best-old-7`` belongs to ``model-best``, never to ``model``), and only those no
    running writer owns: of a process that no longer runs, or of this process's PID but not one of its
    saves in progress (a requeued container run gets its killed predecessor's PID, often 1)."""
    kind = {True: "old-", False: "", None: "(?:old-)?"}[old]
    pattern = re.compile(rf"{re.escape(TMP_PREFIX + directory.name)}-{kind}(\d+)(?:-[0-9a-f]{{8}})?")
    found = []
    for p in directory.parent.glob(glob.escape(f"{TMP_PREFIX}{directory.name}-") + "*"):
        match = pattern.fullmatch(p.name)
        if match is None or p in _OWN_TEMPS:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or not pid_alive(pid):
            found.append(p)
    return found


def _link_target(directory: Path) -> Path:
    """The folder a save of ``directory`` writes: the target of a symlink (dangling or not), else itself."""
    return directory.resolve() if directory.is_symlink() else directory


def restore_aside(directory: str | Path) -> Path | None:
    """Put back the folder that :func:`replaced_dir` had renamed aside when it was killed between its
    two renames (``directory``, or the target of the symlink ``directory``, missing;
    ``.tmp-<name>-old-<pid>-<random>`` that no running writer owns present: the newest such copy).
    Returns the folder restored, or ``None`` when there was nothing to do."""
    directory = _link_target(Path(directory))
    if directory.exists() or directory.is_symlink():
        return None
    aside = sorted(_temp_siblings(directory, old=True), key=lambda p: p.stat().st_mtime)
    if not aside:
        return None
    aside[-1].rename(directory)
    fsync_path(directory.parent)
    return directory


@contextlib.contextmanager
def replaced_dir(directory: str | Path):
    """Write a folder as a whole: yields a fresh temp sibling to fill; on success it replaces
    ``directory`` (old folder renamed aside, new one renamed into place, old one deleted), on any
    failure it is deleted and ``directory`` is left as it was. Readers see the old folder or the
    complete new one (or, killed between the two renames, none until the next write, which puts the
    old one back first: never a mix of the two, never a lost folder)."""
    directory = _link_target(Path(directory))  # a link to the real folder: replace that one
    directory.parent.mkdir(parents=True, exist_ok=True)
    restore_aside(directory)
    for leftover in _temp_siblings(directory, old=None):  # of interrupted saves
        shutil.rmtree(leftover, ignore_errors=True)
    token = f"{os.getpid()}-{secrets.token_hex(4)}"  # unique: a requeued run may get a killed one's PID
    stage = directory.with_name(f"{TMP_PREFIX}{directory.name}-{token}")
    old = directory.with_name(f"{TMP_PREFIX}{directory.name}-old-{token}")
    stage.mkdir()
    _OWN_TEMPS.update((stage, old))
    try:
        yield stage
        follow_umask(stage)
        for f in stage.iterdir():
            if f.is_file():
                fsync_path(f)
        if directory.is_dir():
            directory.rename(old)
            try:
                stage.rename(directory)
            except BaseException:
                old.rename(directory)  # the earlier folder back in place
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(stage, directory)  # raises for a file (or a dangling link) in the way: nothing removed
        fsync_path(directory.parent)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    finally:
        _OWN_TEMPS.difference_update((stage, old))
