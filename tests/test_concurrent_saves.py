"""Saves into one folder from several processes or threads at once (every DDP rank calling
``linearize.save_pretrained`` without a main-process guard), writers killed mid-save, crafted lock files,
read-only folders: the folder always holds one complete save (the last one), never none nor a mix.

The truth is each saved model's own outputs, computed from its seed here (not read back through the
code under test); a loaded model must give exactly those of one of the models saved.
"""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import linearize
from linearize._files import SAVE_LOCK_NAME
from linearize.deploy import FOLDED_CONFIG
from linearize.serialization import CONFIG_NAME

pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH = 256
X = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
WRITERS = 2
ROUNDS = 12


def _fresh() -> nn.Module:
    """The MLP every writer converts, with the weights every one of them keeps: loads put the units on these
    weights in any linearize version, so these tests see the saves' concurrency only."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4))


def _converted(seed: int) -> nn.Module:
    """:func:`_fresh` converted, with the slopes of ``seed`` (a mix of two saves shows in its outputs)."""
    return _reseed(linearize.convert(_fresh(), example_inputs=X), seed)


def _reseed(model: nn.Module, seed: int) -> nn.Module:
    """``model`` with the slopes of ``seed``, in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.copy_(torch.rand(u.num_channels, generator=g))
    return model.eval()


def _plain(seed: int) -> nn.Module:
    """A folded-like model of torch.nn layers only (save_folded needs no base for it); its last bias starts
    with ``seed``, which names the model a folder holds."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4)).eval()
    with torch.no_grad():
        model[-1].bias[0] = seed
    return model


def _outputs(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(X)


def _round_seeds(r: int) -> list[int]:
    """The seeds the writers save in round ``r``: one model for all (as DDP ranks hold), or one each."""
    return [100 * r] * WRITERS if r % 2 == 0 else [100 * r + w + 1 for w in range(WRITERS)]


def _writer(rank: int, sidecar: str, folded: str, barrier, errors) -> None:
    """Process body: in every round, after the start barrier, save this writer's model of that round into both
    folders (``save_pretrained`` and ``save_folded``), then wait for the others."""
    torch.set_num_threads(1)
    model = _converted(0)
    for r in range(ROUNDS):
        seed = _round_seeds(r)[rank]
        _reseed(model, seed)
        plain = _plain(seed)
        barrier.wait()
        for save in (lambda: linearize.save_pretrained(model, sidecar),
                     lambda: linearize.save_folded(plain, folded, example_inputs=X)):
            try:
                save()
            except Exception as err:  # noqa: BLE001 -- reported to the parent, which fails the test
                errors.put(f"writer {rank}, round {r}: {type(err).__name__}: {err}")
        barrier.wait()


def _loaded(sidecar: Path, folded: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of what each folder loads."""
    return (_outputs(linearize.from_pretrained(_fresh(), sidecar, example_inputs=X)),
            _outputs(linearize.load_folded(folded)))


def _one_of(out: torch.Tensor, truths: dict[int, torch.Tensor]) -> list[int]:
    return [seed for seed, t in truths.items() if torch.equal(out, t)]


def test_processes_saving_into_one_folder_leave_one_complete_save(tmp_path, monkeypatch):
    """WRITERS processes x ROUNDS rounds save into one folder at once (with save_pretrained, and with save_folded
    into another), all one model or each its own; a load racing the saves and a load after them each give
    exactly the outputs of one saved model, and every save succeeds. Before the save lock, a save removed the
    files another had just written: unloadable folders in about half the rounds."""
    sidecar, folded = tmp_path / "units", tmp_path / "folded"
    monkeypatch.setenv("LINEARIZE_CPU_KERNEL", "0")  # the writers start faster; same values
    ctx = mp.get_context("spawn")
    barrier, errors = ctx.Barrier(WRITERS + 1, timeout=120), ctx.Queue()
    writers = [ctx.Process(target=_writer, args=(w, str(sidecar), str(folded), barrier, errors))
               for w in range(WRITERS)]
    for p in writers:
        p.start()
    try:
        truths_units, truths_folded = {}, {}
        for r in range(ROUNDS):
            seeds = _round_seeds(r)
            earlier_units, earlier_folded = dict(truths_units), dict(truths_folded)
            truths_units = {s: _outputs(_converted(s)) for s in seeds}
            truths_folded = {s: _outputs(_plain(s)) for s in seeds}
            barrier.wait()
            if r:  # while the writers save: the previous round's save or one of this round's
                racing = _loaded(sidecar, folded)
                assert _one_of(racing[0], earlier_units | truths_units), f"round {r}: racing load of the units"
                assert _one_of(racing[1], earlier_folded | truths_folded), f"round {r}: racing load_folded"
            barrier.wait()
            units_out, folded_out = _loaded(sidecar, folded)
            assert len(_one_of(units_out, truths_units)) == 1, f"round {r}: the units load no model saved"
            assert len(_one_of(folded_out, truths_folded)) == 1, f"round {r}: load_folded gives no model saved"
        for p in writers:
            p.join(timeout=60)
        assert [p.exitcode for p in writers] == [0] * WRITERS
        reported = []
        while not errors.empty():
            reported.append(errors.get())
        assert reported == []  # every save succeeded: they waited for each other
    finally:
        barrier.abort()
        for p in writers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    # what stays: one save of each kind, no temporary files, the empty lock
    names = sorted(p.name for p in sidecar.iterdir())
    assert len(names) == 3 and CONFIG_NAME in names and SAVE_LOCK_NAME in names, names
    names = sorted(p.name for p in folded.iterdir())
    assert len(names) == 3 and FOLDED_CONFIG in names and SAVE_LOCK_NAME in names, names


@pytest.mark.parametrize("flock", [True, pytest.param(False, marks=pytest.mark.filterwarnings(
    "ignore:.*cannot lock files:RuntimeWarning"))], ids=["flock", "no-flock"])
def test_threads_saving_into_one_folder_leave_one_complete_save(tmp_path, monkeypatch, flock):
    """The same with threads of one process (the models are built first: torch's seed is global), also where
    the filesystem cannot lock files (flock fails with ENOLCK, as on NFS without its lock manager): the threads
    still take turns. Before, they saved unlocked there, and one save removed the tensor file of the other's
    manifest: folders that loaded nothing."""
    if not flock:
        import fcntl

        def no_flock(fd, op):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

        monkeypatch.setattr(fcntl, "flock", no_flock)
    rounds = 6
    models = [[_converted(seed) for seed in _round_seeds(r)] for r in range(rounds)]
    plains = [[_plain(seed) for seed in _round_seeds(r)] for r in range(rounds)]
    barrier = threading.Barrier(WRITERS + 1, timeout=60)
    errors: list[str] = []

    def writer(rank: int) -> None:
        for r in range(rounds):
            barrier.wait()
            try:
                linearize.save_pretrained(models[r][rank], tmp_path / "units")
                linearize.save_folded(plains[r][rank], tmp_path / "folded", example_inputs=X)
            except Exception as err:  # noqa: BLE001 -- the test fails on it below
                errors.append(f"writer {rank}, round {r}: {type(err).__name__}: {err}")
            barrier.wait()

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
    for t in threads:
        t.start()
    try:
        for r in range(rounds):
            barrier.wait()
            barrier.wait()
            units_out, folded_out = _loaded(tmp_path / "units", tmp_path / "folded")
            assert any(torch.equal(units_out, _outputs(m)) for m in models[r]), f"round {r}: units"
            assert any(torch.equal(folded_out, _outputs(m)) for m in plains[r]), f"round {r}: folded"
    finally:
        barrier.abort()
        for t in threads:
            t.join(timeout=30)
    assert errors == []


# ----------------------------------------------------------------------------- writers killed mid-save

_LOOP = """
import sys, torch
sys.path.insert(0, {tests!r})
import linearize
from test_concurrent_saves import _converted, _reseed, _plain, X
torch.set_num_threads(1)
model = _converted(0)
seed = {start}
while True:
    seed += 1
    linearize.save_pretrained(_reseed(model, seed), {sidecar!r})
    linearize.save_folded(_plain(seed), {folded!r}, example_inputs=X)
"""


def _seed_of(model: nn.Module) -> int:
    """The seed of a loaded model's slopes (0, or one the killed writers saved: 1001, 1002 ..., 2001 ...)."""
    first = linearize.units(model)[0][1].slope.detach()
    for seed in [0] + [1000 * w + k for w in range(1, WRITERS + 1) for k in range(1, 1000)]:
        if torch.equal(torch.rand(first.numel(), generator=torch.Generator().manual_seed(seed)), first):
            return seed
    raise AssertionError("the loaded slopes are those of no seed saved")


def test_writers_killed_mid_save_leave_a_complete_save_and_no_stuck_lock(tmp_path):
    """kill -9 of WRITERS processes saving in a loop into the same folders, at staggered moments (in a save,
    holding the lock, waiting for it): each folder loads one complete save (the whole model of the seed it
    names), and the next save neither waits for a dead writer's lock nor keeps its temporary files."""
    sidecar, folded = tmp_path / "units", tmp_path / "folded"
    linearize.save_pretrained(_converted(0), sidecar)
    linearize.save_folded(_plain(0), folded, example_inputs=X)
    first = (sidecar / CONFIG_NAME).read_bytes()
    env = dict(os.environ, OMP_NUM_THREADS="1", LINEARIZE_CPU_KERNEL="0")  # a faster start; same values
    logs = [tmp_path / f"writer{w}.log" for w in range(WRITERS)]
    procs = [subprocess.Popen([sys.executable, "-c", _LOOP.format(tests=str(Path(__file__).parent),
                                                                  start=1000 * (w + 1), sidecar=str(sidecar),
                                                                  folded=str(folded))],
                              env=env, stderr=log.open("w")) for w, log in enumerate(logs)]
    try:
        deadline = time.monotonic() + 60
        while (sidecar / CONFIG_NAME).read_bytes() == first and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [log.read_text()[-2000:] for log in logs]
            time.sleep(0.002)  # until the writers are in their save loops
        time.sleep(0.2)
        for p, pause in zip(procs, (0.0, 0.013, 0.029)):
            time.sleep(pause)
            p.kill()  # SIGKILL: no clean-up runs
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    assert [p.returncode for p in procs] == [-9] * WRITERS, [log.read_text()[-2000:] for log in logs]
    loaded = linearize.from_pretrained(_fresh(), sidecar, example_inputs=X)
    seed = _seed_of(loaded)
    assert seed > 0 and torch.equal(_outputs(loaded), _outputs(_converted(seed)))
    out = linearize.load_folded(folded)
    seed = int(out[-1].bias[0])
    assert torch.equal(_outputs(out), _outputs(_plain(seed)))
    start = time.monotonic()
    linearize.save_pretrained(_converted(1), sidecar)
    linearize.save_folded(_plain(1), folded, example_inputs=X)
    assert time.monotonic() - start < 10  # the dead writers' locks were released by the OS
    assert not [p.name for d in (sidecar, folded) for p in d.iterdir() if p.name.endswith(".tmp")]
    assert torch.equal(_outputs(linearize.from_pretrained(_fresh(), sidecar, example_inputs=X)),
                       _outputs(_converted(1)))
    assert torch.equal(_outputs(linearize.load_folded(folded)), _outputs(_plain(1)))


# ----------------------------------------------------------------------------- crafted lock files, read-only folders


def test_a_crafted_lock_file_is_refused_and_what_it_points_to_is_untouched(tmp_path):
    """A link at the lock's name (older filelock versions opened it with O_TRUNC: the target emptied) or a
    folder there is refused, naming the lock; the save in the folder stays loadable. A lock file with content
    is only a lock."""
    directory, victim = tmp_path / "units", tmp_path / "precious.txt"
    linearize.save_pretrained(_converted(1), directory)
    victim.write_text("keep me")
    lock = directory / SAVE_LOCK_NAME
    lock.unlink()
    lock.symlink_to(victim)
    with pytest.raises(FileExistsError, match=rf"{SAVE_LOCK_NAME}: the save lock of .* is a symbolic link"):
        linearize.save_pretrained(_converted(2), directory)
    with pytest.raises(FileExistsError, match="symbolic link"):
        linearize.save_folded(_plain(2), directory, example_inputs=X)
    assert victim.read_text() == "keep me"
    lock.unlink()
    lock.mkdir()
    with pytest.raises(FileExistsError, match=r"is a folder; .*remove what is there"):
        linearize.save_pretrained(_converted(2), directory)
    assert torch.equal(_outputs(linearize.from_pretrained(_fresh(), directory, example_inputs=X)),
                       _outputs(_converted(1)))
    lock.rmdir()
    lock.write_text("12345 otherhost 0\n")  # content (a pid, say) means nothing: the OS lock is what counts
    linearize.save_pretrained(_converted(2), directory)
    assert torch.equal(_outputs(linearize.from_pretrained(_fresh(), directory, example_inputs=X)),
                       _outputs(_converted(2)))


def test_a_save_waits_for_the_lock_at_most_its_bound_then_says_who_holds_it(tmp_path, monkeypatch):
    from filelock import FileLock

    from linearize import _files

    directory = tmp_path / "units"
    linearize.save_pretrained(_converted(1), directory)
    monkeypatch.setattr(_files, "SAVE_LOCK_WAIT_S", 0.3)
    held = FileLock(str(directory / SAVE_LOCK_NAME))
    held.acquire()  # another save in progress (a stopped process, say)
    try:
        with pytest.raises(TimeoutError, match=r"another save into this folder has held its lock .* for 0 s"):
            linearize.save_pretrained(_converted(2), directory)
    finally:
        held.release()
    assert torch.equal(_outputs(linearize.from_pretrained(_fresh(), directory, example_inputs=X)),
                       _outputs(_converted(1)))


@pytest.mark.parametrize("err", [errno.ENOLCK, errno.EOPNOTSUPP], ids=["ENOLCK", "EOPNOTSUPP"])
def test_a_folder_that_cannot_be_locked_saves_unlocked_with_one_warning(tmp_path, monkeypatch, err):
    """flock() failing as on NFS without its lock manager (ENOLCK) or a filesystem without locks (EOPNOTSUPP):
    ``save_pretrained`` and ``save_folded`` go ahead without the lock, each with one warning naming the folder,
    and the folder loads the last save (the model's own outputs). Before, the save was refused."""
    import fcntl
    import warnings

    def flock(fd, op):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fcntl, "flock", flock)
    units, folded = tmp_path / "nfs" / "units", tmp_path / "nfs" / "folded"
    for seed in (1, 2):  # the second save replaces the first
        for directory, save in ((units, lambda: linearize.save_pretrained(_converted(seed), units)),
                                (folded, lambda: linearize.save_folded(_plain(seed), folded, example_inputs=X))):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                save()
            messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
            assert len(messages) == 1 and messages[0].startswith(f"{directory}: this filesystem cannot lock files"), \
                messages
        assert torch.equal(_outputs(linearize.from_pretrained(_fresh(), units, example_inputs=X)),
                           _outputs(_converted(seed)))
        assert torch.equal(_outputs(linearize.load_folded(folded)), _outputs(_plain(seed)))


_READ_ONLY = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import linearize
from test_concurrent_saves import _fresh, _converted, _plain, X
torch.set_num_threads(1)
with torch.no_grad():
    print(json.dumps(linearize.from_pretrained(_fresh(), {units!r}, example_inputs=X)(X).flatten().tolist()))
    print(json.dumps(linearize.load_folded({folded!r})(X).flatten().tolist()))
for save in (lambda: linearize.save_pretrained(_converted(2), {units!r}),
             lambda: linearize.save_folded(_plain(2), {folded!r}, example_inputs=X)):
    try:
        save()
        print("saved")
    except PermissionError as err:
        print("refused:", err)
"""


def test_a_read_only_folder_loads_and_a_save_into_it_says_why_not(tmp_path):
    """Loads take no lock: a folder the process cannot write loads; a save into it is refused naming the folder
    and the fix, and changes nothing. (Root writes anywhere: it runs without the capability that allows it.)"""
    import shutil

    units, folded = tmp_path / "units", tmp_path / "folded"
    linearize.save_pretrained(_converted(1), units)
    linearize.save_folded(_plain(1), folded, example_inputs=X)
    before = {d: sorted((p.name, p.read_bytes()) for p in d.iterdir()) for d in (units, folded)}
    command = [sys.executable, "-c", _READ_ONLY.format(tests=str(Path(__file__).parent), units=str(units),
                                                       folded=str(folded))]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: permissions bind no process here")
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    for d in (units, folded):
        d.chmod(0o555)
    try:
        run = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1", LINEARIZE_CPU_KERNEL="0"),
                             capture_output=True, text=True, timeout=120)
    finally:
        for d in (units, folded):
            d.chmod(0o755)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert torch.equal(torch.tensor(json.loads(lines[0])), _outputs(_converted(1)).flatten())
    assert torch.equal(torch.tensor(json.loads(lines[1])), _outputs(_plain(1)).flatten())
    for line, d in zip(lines[2:], (units, folded)):
        assert line.startswith("refused: ") and f"this process cannot write into {d}" in line, line
        assert "give a folder it can write into, or fix its permissions" in line
    assert {d: sorted((p.name, p.read_bytes()) for p in d.iterdir()) for d in (units, folded)} == before
