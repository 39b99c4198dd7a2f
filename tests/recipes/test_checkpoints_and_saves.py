"""The recipes' files survive crashes and tampering: checkpoint pruning and tampered checkpoint state
(recipes/common/), atomic final saves and validated loads of recipes/cifar.py and wmt14.py, folder
saves killed between their renames (the aside copy restored, never another folder's), recipe.json
reads, the decode cache, metrics.json and wall time over resumes. Small models and synthetic files
only; each test states its own truth."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))

import common  # noqa: E402

import linearize  # noqa: E402


def tiny_run(out: Path, keep: int) -> common.Run:
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), linearize.LinearizableActivation("relu", 4, -1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return common.Run(Accelerator(cpu=True), argparse.Namespace(keep_checkpoints=keep), model, optimizer,
                      scheduler, None, out, "f", "test")


def steps_of(out: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*"))


# ----------------------------------------------------------------------------- checkpoint pruning


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path):
    """A run resumed from an earlier checkpoint (here: steps 20 and 30 are left from before) writes
    step 15 with --keep_checkpoints 2: step 15 must survive, and with it the step before."""
    run = tiny_run(tmp_path, keep=5)
    for step in (10, 20, 30):
        common.save_checkpoint(run, step)
    run.args.keep_checkpoints = 2
    common.save_checkpoint(run, 15)
    assert 15 in steps_of(tmp_path) and 10 in steps_of(tmp_path)
    common.save_checkpoint(run, 16)
    assert {15, 16} <= set(steps_of(tmp_path)) and 10 not in steps_of(tmp_path)
    run.args.keep_checkpoints = 1
    common.save_checkpoint(run, 17)
    assert 17 in steps_of(tmp_path) and not {15, 16} & set(steps_of(tmp_path))


@pytest.mark.parametrize("failing", ["model.safetensors", "optimizer.pt"])
def test_a_checkpoint_onto_a_full_disk_names_the_file_and_keeps_the_earlier_one(tmp_path, failing):
    """A file-size limit (RLIMIT_FSIZE, as a full disk) that the checkpoint of step 2 reaches in model.safetensors
    (safetensors' SafetensorError) or, past it, in optimizer.pt (torch.save's "basic_ios::clear: iostream
    error"): an OSError naming that file in the checkpoint's temp folder, the cause and the fix (both named
    no file); the checkpoint of step 1 is left, every byte as written, and still verifies."""
    import re
    import resource

    from accelerate import Accelerator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), linearize.LinearizableActivation("relu", 256, -1))
    optimizer = torch.optim.Adam(model.parameters())  # two moments: optimizer.pt about twice the model's size
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    run = common.Run(Accelerator(cpu=True), argparse.Namespace(keep_checkpoints=0), model, optimizer, scheduler,
                     None, tmp_path, "f", "test")
    first = common.save_checkpoint(run, 1)
    earlier = {p.name: p.read_bytes() for p in first.iterdir()}
    sizes = {name: len(data) for name, data in earlier.items()}
    assert sizes["optimizer.pt"] > 1.5 * sizes["model.safetensors"]
    limit = {"model.safetensors": sizes["model.safetensors"] // 2,  # model.safetensors is written first
             "optimizer.pt": (sizes["model.safetensors"] + sizes["optimizer.pt"]) // 2}[failing]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # Python ignores SIGXFSZ: a larger write fails
    try:
        with pytest.raises(OSError, match=rf"^{re.escape(str(tmp_path / 'checkpoints'))}/\.tmp-step_0*2-\d+/"
                                          rf"{re.escape(failing)}: writing it failed \((SafetensorError|RuntimeError): "
                                          r".*\); is the disk full.*free space on that disk, or give another "
                                          r"--output_dir"):
            common.save_checkpoint(run, 2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert steps_of(tmp_path) == [1]
    assert {p.name: p.read_bytes() for p in first.iterdir()} == earlier
    assert common.read_checkpoint(first).step == 1


def test_rewrite_of_a_step_killed_between_the_renames_keeps_it(tmp_path, monkeypatch):
    """--keep_checkpoints 1, the final step written again (a finished run resumed): interrupted after
    the old folder was removed and before the new one was renamed into place, the next start must
    still find an intact checkpoint of that step."""
    run = tiny_run(tmp_path, keep=1)
    common.save_checkpoint(run, 3)
    real = Path.rename

    def killed(self, target):
        if self.name.startswith(common.TMP_PREFIX) and "-removed-" not in self.name:
            raise KeyboardInterrupt  # stands for SIGKILL at this point
        return real(self, target)

    monkeypatch.setattr(Path, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        common.save_checkpoint(run, 3)
    monkeypatch.setattr(Path, "rename", real)
    common.remove_partial_checkpoints(tmp_path)
    ckpt, skipped = common.find_checkpoint("latest", tmp_path)
    assert ckpt.step == 3 and not skipped
    assert not list((tmp_path / "checkpoints").glob(".*"))


def test_partial_checkpoints_of_a_running_process_are_left_alone(tmp_path, dead_pid):
    """A run's start removes the temp folders of checkpoint writes whose process has ended, never the one a
    process that still runs is writing (here a real second process), until that process has ended."""
    import subprocess

    writer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        writing = tmp_path / "checkpoints" / f"{common.TMP_PREFIX}step_00000002-{writer.pid}"
        writing.mkdir(parents=True)
        (writing / common.MODEL_FILE).write_bytes(b"being written")
        left = tmp_path / "checkpoints" / f"{common.TMP_PREFIX}step_00000001-{dead_pid}"
        left.mkdir()
        assert common.remove_partial_checkpoints(tmp_path) == [left] and not left.exists()
        assert (writing / common.MODEL_FILE).read_bytes() == b"being written"
    finally:
        writer.stdin.close()
        writer.wait()
    assert common.remove_partial_checkpoints(tmp_path) == [writing] and not writing.exists()


# ----------------------------------------------------------------------------- tampered state JSON


def _mutate_files(value):
    def f(s):
        s["files"] = value(s["files"])
        return s
    return f


TAMPER = {
    "files is a list": _mutate_files(lambda f: []),
    "files entry a string": _mutate_files(lambda f: {**f, common.MODEL_FILE: "x"}),
    "files entry lacks size": _mutate_files(lambda f: {**f, common.MODEL_FILE: {"sha256": "0" * 64}}),
    "files empty (nothing verified)": _mutate_files(lambda f: {}),
    "files names a path outside": _mutate_files(lambda f: {"../x": f[common.MODEL_FILE]}),
    "no scheduler": lambda s: {k: v for k, v in s.items() if k != "scheduler"},
    "scheduler a string": lambda s: {**s, "scheduler": "x"},
    "step negative": lambda s: {**s, "step": -5},
    "step a float": lambda s: {**s, "step": 2.5},
    "step a bool": lambda s: {**s, "step": True},
    "step not the folder's": lambda s: {**s, "step": 7},
    "elapsed_s negative": lambda s: {**s, "elapsed_s": -1.0},
    "elapsed_s a string": lambda s: {**s, "elapsed_s": "10"},
}


@pytest.mark.parametrize("tamper", list(TAMPER))
def test_latest_skips_a_tampered_state_json(tmp_path, tamper):
    """The newest checkpoint's recipe_state.json is edited: `latest` must skip it with a
    CheckpointError reason and resume from the previous step (never crash, never use it)."""
    run = tiny_run(tmp_path, keep=5)
    common.save_checkpoint(run, 1)
    newest = common.save_checkpoint(run, 2)
    state = json.loads((newest / common.STATE_FILE).read_text())
    (newest / common.STATE_FILE).write_text(json.dumps(TAMPER[tamper](state)))
    ckpt, skipped = common.find_checkpoint("latest", tmp_path)
    assert ckpt.step == 1
    assert len(skipped) == 1 and "step_00000002" in skipped[0]
    with pytest.raises(common.CheckpointError):
        common.read_checkpoint(newest)


# ----------------------------------------------------------------------------- cifar final model


def _cifar_model(seed: int):
    import cifar

    torch.manual_seed(seed)
    model = linearize.convert(cifar.build_model("resnet20", 3), mode="prelu", example_inputs=torch.zeros(2, 3, 8, 8))
    with torch.no_grad():
        for _, unit in linearize.units(model):
            unit.slope.uniform_(0, 1)
    return model


def _save(model, directory: Path, classes: tuple[str, ...] = ("a", "b", "c")) -> None:
    import cifar

    args = argparse.Namespace(arch="resnet20", dataset="cifar10", image_size=8, linearize="prelu")
    cifar.save_final(model, directory, args, list(classes), torch.zeros(3), torch.ones(3))


def _same_state(model, reference: dict[str, torch.Tensor]) -> bool:
    state = model.state_dict()
    return state.keys() == reference.keys() and all(
        torch.equal(state[k].reshape(-1).view(torch.uint8), reference[k].reshape(-1).view(torch.uint8))
        for k in reference)


NEW_CLASSES = ("x", "y", "z")


@pytest.mark.parametrize("call", ["replace", "rename", "fsync", "write"])
def test_cifar_final_save_is_atomic_under_oserror_at_every_call(tmp_path, monkeypatch, call):
    """save_final over an earlier final model fails with OSError at the n-th os.replace / os.rename /
    os.fsync / file write, for every n until it succeeds: each failure leaves the earlier model (all of
    model.safetensors, sidecar and recipe.json) loading bit for bit, with no temp leftovers; the save
    that succeeds loads the new model."""
    import builtins
    import io
    import os

    import cifar

    directory = tmp_path / "out" / "model"
    old_model, new_model = _cifar_model(0), _cifar_model(1)
    old = {k: v.clone() for k, v in old_model.state_dict().items()}
    new = {k: v.clone() for k, v in new_model.state_dict().items()}
    assert not _same_state(new_model, old)
    _save(old_model, directory)

    def failing(real, n):
        count = [0]

        def f(*a, **k):
            count[0] += 1
            if count[0] == n:
                raise OSError(28, "No space left on device (injected)")
            return real(*a, **k)
        return f

    for n in range(1, 200):
        with monkeypatch.context() as m:
            if call == "write":  # the n-th file opened for writing (Path.write_text, os.fdopen, open)
                real_open, counter = io.open, [0]

                def opened(file, mode="r", *a, **k):
                    if isinstance(mode, str) and any(c in mode for c in "wax+"):
                        counter[0] += 1
                        if counter[0] == n:
                            raise OSError(28, "No space left on device (injected)")
                    return real_open(file, mode, *a, **k)
                m.setattr(io, "open", opened)
                m.setattr(builtins, "open", opened)
            else:
                m.setattr(os, call, failing(getattr(os, call), n))
            try:
                _save(new_model, directory, NEW_CLASSES)
                ok = True
            except OSError as e:
                assert "injected" in str(e)
                ok = False
        leftovers = [p.name for p in directory.parent.iterdir() if p.name != "model"]
        assert not leftovers, f"call {n}: left {leftovers}"
        loaded = cifar.load_model(directory)
        classes = tuple(json.loads((directory / "recipe.json").read_text())["classes"])
        if ok:
            assert _same_state(loaded, new) and classes == NEW_CLASSES
            break
        # before the new folder is in place: the earlier model; after (a failed fsync of the parent
        # folder): the new one. Never a mix (weights of one save, recipe.json of the other).
        assert (_same_state(loaded, old) and classes == ("a", "b", "c")) or (
            _same_state(loaded, new) and classes == NEW_CLASSES), f"failed {call} #{n} left a mixed model"
    else:
        pytest.fail("the save never succeeded")


def test_a_final_save_onto_a_full_disk_names_the_folder_and_keeps_the_earlier_model(tmp_path):
    """cifar's final save over an earlier model with a file-size limit (RLIMIT_FSIZE, as a full disk) that the
    ~1 MB model.safetensors reaches (safetensors' SafetensorError named no file): an OSError naming the model
    folder, the cause and the fix; the earlier model loads bit for bit, and no temp folder is left."""
    import re
    import resource

    import cifar

    directory = tmp_path / "out" / "model"
    old_model = _cifar_model(0)
    old = {k: v.clone() for k, v in old_model.state_dict().items()}
    _save(old_model, directory)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))  # the sidecar's units fit, the weights do not
    try:
        with pytest.raises(OSError, match=rf"^{re.escape(str(directory))}: writing it failed \(SafetensorError: .*\); "
                                          r"is the disk full.*free space on that disk, or give another --output_dir"):
            _save(_cifar_model(1), directory, NEW_CLASSES)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert [p.name for p in directory.parent.iterdir()] == ["model"]
    assert _same_state(cifar.load_model(directory), old)


def test_every_file_of_a_final_save_and_a_checkpoint_has_the_mode_open_gives(tmp_path):
    """Under umask 022, every file cifar's final save (model/: weights, sidecar, recipe.json) and a checkpoint
    (model.safetensors, optimizer.pt, state.json) write has the mode a plain open() gives a new file: safetensors
    created the weights owner-only (0600), unreadable to another user of a shared results folder."""
    import stat

    old = os.umask(0o022)
    try:
        with open(tmp_path / "plain", "w"):
            pass
        expected = stat.S_IMODE((tmp_path / "plain").stat().st_mode)
        _save(_cifar_model(0), tmp_path / "model")
        checkpoint = common.save_checkpoint(tiny_run(tmp_path / "run", keep=1), 1)
    finally:
        os.umask(old)
    files = [p for folder in (tmp_path / "model", checkpoint) for p in folder.rglob("*") if p.is_file()]
    assert {"model.safetensors", "recipe.json", "optimizer.pt"} <= {p.name for p in files}
    assert {p.relative_to(tmp_path).as_posix(): oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {
        p.relative_to(tmp_path).as_posix(): oct(expected) for p in files}


def test_a_file_given_for_the_model_folder_or_a_fifo_in_a_save_is_named_not_missing(tmp_path):
    """cifar.load_model given the model folder's recipe.json instead of the folder, a FIFO where recipe.json should
    be, and a checkpoint whose optimizer.pt is a FIFO: each error names the file and what it is (they said the file
    was missing: "no recipe.json in", "optimizer.pt is missing"); the folder itself loads the saved weights."""
    import cifar

    directory = tmp_path / "model"
    model = _cifar_model(0)
    _save(model, directory)
    with pytest.raises(NotADirectoryError, match=rf"{directory}/recipe.json is a file, not a folder: .*pass the "
                                                 rf"folder that holds it \({directory}\)"):
        cifar.load_model(directory / "recipe.json")
    assert _same_state(cifar.load_model(directory), model.state_dict())
    os.replace(directory / "recipe.json", tmp_path / "recipe.json")
    os.mkfifo(directory / "recipe.json")
    with pytest.raises(linearize.LoadError, match=rf"{directory}/recipe.json is not a regular file \(a FIFO"):
        cifar.load_model(directory)

    step = common.save_checkpoint(tiny_run(tmp_path / "run", keep=1), 1)
    (step / common.OPTIMIZER_FILE).unlink()
    os.mkfifo(step / common.OPTIMIZER_FILE)
    with pytest.raises(common.CheckpointError, match=rf"{step}: {common.OPTIMIZER_FILE} is not a regular file "
                                                     r"\(a folder, FIFO, device or socket\)"):
        common.read_checkpoint(step)


def test_cifar_load_model_refuses_a_flipped_bit(tmp_path):
    import cifar

    directory = tmp_path / "model"
    _save(_cifar_model(0), directory)
    f = directory / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0x10  # inside the last tensor's data: safetensors still decodes it
    f.write_bytes(bytes(raw))
    with pytest.raises(linearize.LoadError, match="model.safetensors: missing, truncated or modified"):
        cifar.load_model(directory)


def test_metrics_json_is_written_atomically(tmp_path, monkeypatch):
    """An OSError while writing metrics.json keeps the previous file whole."""
    import os

    args = argparse.Namespace(x=1)
    common.write_metrics(tmp_path, {"acc": 0.5}, args, 0.0, 1, "cpu")
    before = (tmp_path / "metrics.json").read_text()
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "I/O error (injected)")))
    with pytest.raises(OSError, match="injected"):
        common.write_metrics(tmp_path, {"acc": 0.9}, args, 0.0, 1, "cpu")
    assert (tmp_path / "metrics.json").read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


# ----------------------------------------------------------------------------- cifar decode cache


class WritesMarker:
    """A pickle whose unpickling creates a file (code execution)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _damage_cache(kind: str, cache: Path, marker: Path) -> None:
    if kind == "truncated":
        cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])
    elif kind == "empty":
        cache.write_bytes(b"")
    elif kind == "code":
        torch.save({"x": WritesMarker(marker)}, cache)
    elif kind == "wrong shape":
        torch.save({"x": torch.zeros(2, 3, 4, 4, dtype=torch.uint8), "y": torch.zeros(2, dtype=torch.long),
                    "classes": ["a"]}, cache)
    elif kind == "labels out of range":
        d = torch.load(cache, weights_only=True)
        d["y"] = d["y"] + 7
        torch.save(d, cache)


@pytest.mark.parametrize("kind", ["truncated", "empty", "code", "wrong shape", "labels out of range"])
def test_a_damaged_cifar_cache_is_decoded_again(tmp_path, kind):
    """The decode cache is a file anyone with access to the cache folder can replace: a damaged or
    crafted one runs no code and is neither fatal nor used; the split is decoded again, equal to the
    first decode (the truth: the images on disk)."""
    from torchvision.io import write_png

    import cifar

    for split, n in (("train", 3), ("test", 2)):
        for c in ("cat", "dog"):
            (tmp_path / "data" / split / c).mkdir(parents=True)
            for i in range(n):
                write_png(torch.full((3, 8, 8), 40 * i + (c == "dog") * 9, dtype=torch.uint8),
                          str(tmp_path / "data" / split / c / f"{i}.png"))
    cache_dir = tmp_path / "cache"
    first = cifar.load_split(tmp_path / "data", "cifar10", "train", None, 8, cache_dir, show=False)
    (cache,) = cache_dir.glob("*.pt")
    marker = tmp_path / "marker"
    _damage_cache(kind, cache, marker)
    with pytest.warns(RuntimeWarning, match="damaged CIFAR cache"):
        again = cifar.load_split(tmp_path / "data", "cifar10", "train", None, 8, cache_dir, show=False)
    assert not marker.exists()
    assert torch.equal(again["x"], first["x"]) and torch.equal(again["y"], first["y"])
    assert again["classes"] == first["classes"] == ["cat", "dog"]
    third = cifar.load_split(tmp_path / "data", "cifar10", "train", None, 8, cache_dir, show=False)
    assert torch.equal(third["x"], first["x"])  # the cache was rewritten whole
    assert [p.name for p in cache_dir.iterdir()] == [cache.name]


# ----------------------------------------------------------------------------- the linear threshold


# ----------------------------------------------------------------------------- kernel build lock


# ----------------------------------------------------------------------------- report --checkpoint


# ----------------------------------------------------------------------------- sparsifier weights


# ----------------------------------------------------------------------------- wmt14 final model


class _Writes:
    """Stands in for a Hugging Face model or tokenizer: save_pretrained writes one file, or fails."""

    def __init__(self, name: str, text: str, fail: bool = False) -> None:
        self.name, self.text, self.fail = name, text, fail

    def save_pretrained(self, directory: str) -> None:
        (Path(directory) / self.name).write_text(self.text)
        if self.fail:
            raise OSError(28, "No space left on device (injected)")


def test_wmt14_final_save_is_atomic(tmp_path):
    """An OSError while the tokenizer is written leaves the earlier final model folder as it was
    (not new weights beside the old tokenizer and recipe.json), and no temp folder."""
    import wmt14

    args = argparse.Namespace(model_size="tiny", source_lang="en", target_lang="de", linearize="none")
    directory = tmp_path / "model"
    wmt14.save_final(_Writes("model.safetensors", "old weights"), _Writes("tokenizer.json", "old tok"), directory,
                     args)
    before = {p.name: p.read_text() for p in directory.iterdir()}
    with pytest.raises(OSError, match="injected"):
        wmt14.save_final(_Writes("model.safetensors", "new weights"), _Writes("tokenizer.json", "new", fail=True),
                         directory, args)
    assert {p.name: p.read_text() for p in directory.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    wmt14.save_final(_Writes("model.safetensors", "new weights"), _Writes("tokenizer.json", "new tok"), directory,
                     args)
    assert (directory / "model.safetensors").read_text() == "new weights"
    assert (directory / "tokenizer.json").read_text() == "new tok"


def test_a_flipped_digit_in_the_state_json_is_caught(tmp_path):
    """recipe_state.json holds the LR scheduler's state: a changed digit there (still valid JSON)
    would resume with another learning rate; `latest` must skip it."""
    run = tiny_run(tmp_path, keep=5)
    for _ in range(3):
        run.scheduler.step()
    common.save_checkpoint(run, 1)
    newest = common.save_checkpoint(run, 2)
    text = (newest / common.STATE_FILE).read_text()
    assert '"last_epoch": 3' in text
    (newest / common.STATE_FILE).write_text(text.replace('"last_epoch": 3', '"last_epoch": 7'))
    ckpt, skipped = common.find_checkpoint("latest", tmp_path)
    assert ckpt.step == 1 and len(skipped) == 1 and "step_00000002" in skipped[0]


def test_cifar_cache_notices_images_added_to_a_class_folder(tmp_path):
    """The cache key covered the data folder's own size and mtime only: an image added to (or
    replaced in) train/<class>/ leaves those unchanged, and the stale decode was served."""
    import os

    from torchvision.io import write_png

    import cifar

    def image(path: Path, value: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_png(torch.full((3, 8, 8), value, dtype=torch.uint8), str(path))

    for c in ("cat", "dog"):
        for i in range(2):
            image(tmp_path / "data" / "train" / c / f"{i}.png", 10 * i)
    root_stat = os.stat(tmp_path / "data")
    cache_dir = tmp_path / "cache"
    first = cifar.load_split(tmp_path / "data", "cifar10", "train", None, 8, cache_dir, show=False)
    assert len(first["y"]) == 4
    image(tmp_path / "data" / "train" / "cat" / "2.png", 200)
    os.utime(tmp_path / "data", ns=(root_stat.st_atime_ns, root_stat.st_mtime_ns))
    second = cifar.load_split(tmp_path / "data", "cifar10", "train", None, 8, cache_dir, show=False)
    assert sorted(second["y"].tolist()) == [0, 0, 0, 1, 1]  # the truth: 3 cat and 2 dog images on disk


def test_final_save_through_a_symlink_and_onto_a_file(tmp_path):
    """OUTPUT_DIR/model as a link to a folder elsewhere: the save lands there and the link stays;
    a file in its place: a clear OSError, the file untouched, no temp folder left."""
    import wmt14

    args = argparse.Namespace(model_size="tiny", source_lang="en", target_lang="de", linearize="none")
    real = tmp_path / "elsewhere" / "model"
    real.mkdir(parents=True)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model").symlink_to(real)
    wmt14.save_final(_Writes("model.safetensors", "w"), _Writes("tokenizer.json", "t"), tmp_path / "out" / "model",
                     args)
    assert (tmp_path / "out" / "model").is_symlink() and (real / "tokenizer.json").read_text() == "t"
    blocker = tmp_path / "file" / "model"
    blocker.parent.mkdir()
    blocker.write_text("not a folder")
    with pytest.raises(OSError):
        wmt14.save_final(_Writes("model.safetensors", "w"), _Writes("tokenizer.json", "t"), blocker, args)
    assert blocker.read_text() == "not a folder" and [p.name for p in blocker.parent.iterdir()] == ["model"]


# ----------------------------------------------------------------------------- whole-folder saves


def test_replaced_dir_killed_between_the_renames_loses_nothing(tmp_path, dead_pid):
    """A final-model save (recipes' replaced_dir) SIGKILLed after the old folder was renamed aside and
    before the new one was renamed into place: the next load or save must find the old folder (the
    truth: its file as first written), never delete it as a leftover."""
    import subprocess
    import textwrap

    target = tmp_path / "model"
    with common.replaced_dir(target) as stage:
        (stage / "recipe.json").write_text('{"v": 1}')
    script = textwrap.dedent(f"""
        import os, signal, sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO / "recipes")!r})
        import common
        real = Path.rename
        def rename(self, dest):
            if "-old-" not in self.name and self.name.startswith(common.TMP_PREFIX):
                os.kill(os.getpid(), signal.SIGKILL)  # between the two renames
            return real(self, dest)
        Path.rename = rename
        with common.replaced_dir({str(target)!r}) as stage:
            (stage / "recipe.json").write_text('{{"v": 2}}')
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert not target.exists() and list(tmp_path.glob(f"{common.TMP_PREFIX}model-old-*"))
    assert common.read_recipe_json(target) == {"v": 1}  # a load puts it back
    assert not list(tmp_path.glob(f"{common.TMP_PREFIX}model-old-*"))
    # a save after a kill (nothing loaded in between) keeps the old folder until the new one is complete
    target.rename(tmp_path / f"{common.TMP_PREFIX}model-old-{dead_pid}")
    with pytest.raises(RuntimeError):
        with common.replaced_dir(target):
            raise RuntimeError("failed while writing the new one")
    assert json.loads((target / "recipe.json").read_text()) == {"v": 1}
    with common.replaced_dir(target) as stage:
        (stage / "recipe.json").write_text('{"v": 3}')
    assert json.loads((target / "recipe.json").read_text()) == {"v": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_read_recipe_json_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no recipe.json in {tmp_path}"):
        common.read_recipe_json(tmp_path)
    (tmp_path / "recipe.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        common.read_recipe_json(tmp_path)
    (tmp_path / "recipe.json").write_bytes(b"\xff{")
    with pytest.raises(ValueError, match="not valid JSON"):
        common.read_recipe_json(tmp_path)
    (tmp_path / "recipe.json").write_text('{"arch": ' + "9" * 5000 + "}")  # past Python's int-string limit
    with pytest.raises(ValueError, match=f"{tmp_path}/recipe.json is not valid JSON"):
        common.read_recipe_json(tmp_path)


def test_wall_time_adds_up_over_resumes(tmp_path):
    """metrics.json's wall_time_s is the run's, not the last process's: a run resumed from a checkpoint
    written 100 s into it reports 100 s plus its own time (truth: the clock offsets set here); a damaged
    elapsed_s is refused by the checkpoint check itself (no digest in the state)."""
    import time

    run = tiny_run(tmp_path, keep=2)
    run.started = time.time() - 100.0  # this process has run for 100 s
    path = common.save_checkpoint(run, 1)
    resumed = tiny_run(tmp_path, keep=2)
    common.load_checkpoint(resumed, common.read_checkpoint(path))
    assert 100.0 <= resumed.earlier_s < 110.0
    start = time.time() - 5.0  # the resumed process ran 5 s
    out = common.write_metrics(tmp_path, {}, argparse.Namespace(), start, 1, "cpu", resumed.earlier_s)
    metrics = json.loads(out.read_text())
    assert 105.0 <= metrics["wall_time_s"] < 120.0 and 5.0 <= metrics["wall_time_this_process_s"] < 15.0
    state = json.loads((path / common.STATE_FILE).read_text())
    state.pop("state_sha256")
    for bad in (-1.0, "10", float("nan")):
        assert "elapsed_s" in common.state_problem({**state, "elapsed_s": bad}, path)
    assert common.state_problem(state, path) is None


def test_save_of_one_folder_keeps_the_aside_copy_of_a_sibling(tmp_path, dead_pid):
    """Truth (replaced_dir docs: "never a lost folder"): a save of ``model`` killed between its renames
    leaves ``.tmp-model-best-old-<pid>`` for the sibling ``model-best``; writing the *other* folder
    ``model`` must not delete it, and ``restore_aside(model-best)`` must bring it back. Observed: the
    leftover glob ``.tmp-model-*`` of ``model`` matches and removes it, so ``model-best`` is lost."""
    aside = tmp_path / f"{common.TMP_PREFIX}model-best-old-{dead_pid}"
    aside.mkdir()
    (aside / "recipe.json").write_text('{"v": 1}')
    with common.replaced_dir(tmp_path / "model") as stage:
        (stage / "recipe.json").write_text('{"v": 2}')
    assert common.read_recipe_json(tmp_path / "model-best") == {"v": 1}


def test_restore_aside_never_restores_another_folders_copy(tmp_path, dead_pid):
    """Truth: ``restore_aside(dir)`` puts back ``dir``'s own aside copy (``.tmp-<dir>-old-<pid>``) only.
    With ``model`` missing and only ``.tmp-model-old-old-7`` present (the aside copy of the sibling
    folder ``model-old``), nothing must be restored into ``model``. Observed: the glob
    ``.tmp-model-old-*`` matches it, and ``model-old``'s content becomes ``model``."""
    other = tmp_path / f"{common.TMP_PREFIX}model-old-old-{dead_pid}"
    other.mkdir()
    assert common.restore_aside(tmp_path / "model") is None
    assert other.exists()


def test_restore_aside_with_glob_characters_in_the_name(tmp_path, dead_pid):
    """Truth: a folder ``run[a]`` set aside as ``.tmp-run[a]-old-5`` by a killed replaced_dir is put
    back. Observed: ``glob('.tmp-run[a]-*')`` reads ``[a]`` as a character class: None, folder lost."""
    aside = tmp_path / f"{common.TMP_PREFIX}run[a]-old-{dead_pid}"
    aside.mkdir()
    (aside / "recipe.json").write_text("{}")
    assert common.restore_aside(tmp_path / "run[a]") == tmp_path / "run[a]"
    assert (tmp_path / "run[a]" / "recipe.json").is_file()


def test_final_save_after_a_killed_one_with_the_same_pid(tmp_path):
    """Truth: a requeued container run gets its killed predecessor's PID (often 1), so a leftover stage
    ``.tmp-model-<own pid>`` or aside copy ``.tmp-model-old-<own pid>`` is no writer's in progress (this
    process made neither): restore_aside puts the aside copy back (its file as first written), and the
    save replaces the folder with this run's file, leaving no temp folder. Observed: the PID counts as
    alive, the leftover stays and ``stage.mkdir()`` raises FileExistsError on every retry."""
    aside = tmp_path / f"{common.TMP_PREFIX}model-old-{os.getpid()}"
    aside.mkdir()
    (aside / "recipe.json").write_text('{"v": 1}')
    assert common.restore_aside(tmp_path / "model") == tmp_path / "model"
    assert common.read_recipe_json(tmp_path / "model") == {"v": 1}
    killed = tmp_path / f"{common.TMP_PREFIX}model-{os.getpid()}"  # a half-written stage of the killed save
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"\0" * 10)
    with common.replaced_dir(tmp_path / "model") as stage:
        (stage / "recipe.json").write_text('{"v": 2}')
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["recipe.json"]
    assert common.read_recipe_json(tmp_path / "model") == {"v": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_read_recipe_json_through_a_symlink_after_a_kill(tmp_path, dead_pid):
    """Truth: replaced_dir(link) writes the link's target; killed between its two renames it leaves the
    target aside as ``.tmp-real-old-<pid>``; read_recipe_json(link) puts it back and reads it. Observed:
    the link is dangling, restore_aside(link) returns at ``is_symlink()``: FileNotFoundError."""
    real, link = tmp_path / "real", tmp_path / "model"
    real.mkdir()
    (real / "recipe.json").write_text('{"old": 1}')
    link.symlink_to(real)
    with common.replaced_dir(link) as stage:  # the resolved target is what gets replaced
        assert stage.name.startswith(f"{common.TMP_PREFIX}real-")
    (link / "recipe.json").write_text('{"old": 1}')
    real.rename(tmp_path / f"{common.TMP_PREFIX}real-old-{dead_pid}")  # the state a SIGKILL between the renames leaves
    assert common.read_recipe_json(link) == {"old": 1}


def test_checkpoint_written_after_a_clock_step_back_is_readable(tmp_path):
    """Truth: save_checkpoint writes an intact checkpoint that read_checkpoint accepts, whatever the wall
    clock did (time.time() steps back under NTP; here by 30 s after the process began, before its first
    checkpoint). Observed: elapsed_s = earlier_s + time.time() - started is -30 s, written as is, and the
    reader refuses it as 'damaged or was edited': no intact checkpoint to resume from."""
    run = tiny_run(tmp_path, keep=2)
    run.started += 30  # the same as time.time() now reading 30 s less than when the process began
    path = common.save_checkpoint(run, 10)
    assert common.read_checkpoint(path).elapsed_s >= 0


def test_reader_between_the_renames_of_a_live_save(tmp_path, monkeypatch):
    """Truth: a reader (read_recipe_json, e.g. an evaluation process) that looks while a save is between its
    two renames does not break that save: the new folder lands. ``.tmp-model-old-<pid>`` of a *running*
    process is not a leftover. Observed: the reader renames it back to ``model``, the writer's second
    rename fails, its fallback rename of the (gone) old folder raises, and the new model is deleted."""
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "recipe.json").write_text('{"v": "old"}')
    rename = Path.rename

    def rename_then_read(self, target):
        out = rename(self, target)
        if Path(target).name.startswith(f"{common.TMP_PREFIX}model-old-"):  # between the two renames
            with pytest.raises(FileNotFoundError):  # the reader finds no model for that instant, and says so
                common.read_recipe_json(directory)
        return out

    monkeypatch.setattr(Path, "rename", rename_then_read)
    with common.replaced_dir(directory) as stage:
        (stage / "recipe.json").write_text('{"v": "new"}')
    assert json.loads((directory / "recipe.json").read_text()) == {"v": "new"}


def test_recipe_json_missing_keys_named(tmp_path):
    """Truth (read_recipe_json: 'a clear error' naming the folder for a damaged save): a recipe.json that
    parses but lacks ``arch`` is refused with an error naming the file and the key. Observed: cifar's
    load_model raises ``KeyError: 'arch'``."""
    import cifar

    (tmp_path / "recipe.json").write_text('{"linearize": "none"}')
    with pytest.raises(ValueError, match="recipe.json"):
        cifar.load_model(tmp_path)


def test_a_tar_rewritten_with_the_same_size_and_mtime_is_read_again(tmp_path):
    """The header pass over a tar archive is cached per process; an archive rewritten in place with the same size
    and modification time (members in another order, as cp -p or rsync -t of another build leave it) must be
    read again, not at the old offsets (the truth: each image decoded from its own PNG file)."""
    import os
    import tarfile

    import cifar
    from torchvision.io import decode_image, write_png

    images = {}
    for i, c in enumerate(("cat", "dog")):
        (tmp_path / "src" / "test" / c).mkdir(parents=True)
        images[c] = torch.full((3, 8, 8), 40 * (i + 1), dtype=torch.uint8)
        write_png(images[c], str(tmp_path / "src" / "test" / c / "0.png"))
    archive = tmp_path / "data.tar"  # uncompressed: the rewrite keeps the size exactly

    def pack(order: list[str]) -> None:
        with tarfile.open(archive, "w") as tar:
            for c in order:
                tar.add(tmp_path / "src" / "test" / c / "0.png", f"test/{c}/0.png")

    pack(["cat", "dog"])
    first = cifar._from_tar(archive, "test", None, 8, False, None, False)
    stat = archive.stat()
    pack(["dog", "cat"])
    os.utime(archive, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (archive.stat().st_size, archive.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    again = cifar._from_tar(archive, "test", None, 8, False, None, False)
    for got in (first, again):
        assert got["classes"] == ["cat", "dog"]
        for x, label in zip(got["x"], got["y"]):
            assert torch.equal(x, decode_image(str(tmp_path / "src" / "test" / got["classes"][label] / "0.png")))


def test_a_save_after_a_removal_that_left_files_behind(tmp_path, monkeypatch):
    """remove_earlier_outputs of a folded/ whose files cannot all be deleted (simulated: rmtree deletes nothing,
    as for a read-only or NFS-open file), then replaced_dir of folded/ in the same process: the save lands
    (its stage never shares the removal's temp name) and the removal warns naming what it left."""
    import common.outputs as outputs

    (tmp_path / "folded").mkdir()
    (tmp_path / "folded" / "old.bin").write_bytes(b"earlier")
    monkeypatch.setattr(outputs.shutil, "rmtree", lambda *a, **k: None)
    with pytest.warns(RuntimeWarning, match=r"removed-\d+: an earlier run's output that could not be deleted"):
        common.remove_earlier_outputs(tmp_path, ["folded"])
    monkeypatch.undo()
    with common.replaced_dir(tmp_path / "folded") as stage:
        (stage / "new.bin").write_bytes(b"this run")
    assert [p.name for p in (tmp_path / "folded").iterdir()] == ["new.bin"]


def test_removal_sweeps_temp_folders_of_ended_processes_only(tmp_path, dead_pid):
    """Temp folders a killed removal or save of report/ left (``.tmp-report-<pid>``, ``-removed-<pid>``,
    ``-old-<pid>``) are deleted by the next removal of report/ when their process has ended; a live process's
    and another output's are kept."""
    live = os.getpid()
    names = [f"report-{dead_pid}", f"report-removed-{dead_pid}", f"report-old-{dead_pid}", f"report-removed-{live}",
             f"report-best-{dead_pid}"]
    for n in names:
        (tmp_path / f"{common.TMP_PREFIX}{n}").mkdir()
        (tmp_path / f"{common.TMP_PREFIX}{n}" / "report.json").write_text("{}")
    common.remove_earlier_outputs(tmp_path, ["report"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{common.TMP_PREFIX}{n}" for n in [f"report-removed-{live}", f"report-best-{dead_pid}"])


@pytest.mark.parametrize("content", [None, "", '{"sites": ', "[1, 2]", "nan" * 3, "folder", "fifo"])
def test_a_runs_record_that_is_missing_damaged_or_not_an_object_is_refused_by_name(tmp_path, content):
    """The kept channels of a pruned run and the one-shot record of a Multi30k run are read back on resume and
    load: a missing, truncated or non-object file (or a folder, or a FIFO that no one writes: never waited on) is
    a ValueError naming the file and the fix, never a raw JSON error or a hang."""
    path = tmp_path / common.KEPT_FILE
    if content == "folder":
        path.mkdir()
    elif content == "fifo":
        os.mkfifo(path)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=rf"{path.name} .*restore the file"):
        common.read_kept(tmp_path)
    path_ok = tmp_path / "ok"
    path_ok.mkdir()
    (path_ok / common.KEPT_FILE).write_text('{"sites": {"a": [0, 2]}}')
    assert common.read_kept(path_ok) == {"sites": {"a": [0, 2]}}
