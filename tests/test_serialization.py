"""Sidecar save/load: bit-identical round trips, clear errors on mismatch, saves atomic as a pair,
loads validated (damaged, truncated or tampered files refused with the file and the unit named)."""

import errno
import hashlib
import json
import os
import re

import pytest
import safetensors.torch
import torch
import torchvision
import transformers as hf
from torch import nn

import linearize
from linearize import serialization
from linearize._files import SAVE_LOCK_NAME
from linearize.serialization import CONFIG_NAME


def build(name="resnet18"):
    torch.manual_seed(0)
    return torchvision.models.get_model(name, weights=None, num_classes=10)


X = torch.randn(1, 3, 32, 32)


def trained_like(model):
    linearize.convert(model, example_inputs=X)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.copy_(torch.rand(u.num_channels, generator=gen))
    first = linearize.units(model)[0][1]
    first.freeze_(torch.arange(first.num_channels) < 3, 1.0)
    return model.eval()


def test_round_trip_is_bit_identical(tmp_path):
    model = trained_like(build())
    linearize.save_pretrained(model, tmp_path)
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    weights = tmp_path / meta["weights"]["file"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CONFIG_NAME, weights.name, SAVE_LOCK_NAME])
    assert (tmp_path / SAVE_LOCK_NAME).stat().st_size == 0  # the (empty) save lock stays in the folder
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert meta["weights"]["sha256"] == digest and weights.name == f"linearize_units-{digest[:16]}.safetensors"
    assert len(meta["sites"]) == 17 and meta["config"]["mode"] == "prelu"
    loaded = linearize.from_pretrained(build(), tmp_path, example_inputs=X).eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    torch.testing.assert_close(linearize.units(loaded)[0][1].frozen, linearize.units(model)[0][1].frozen,
                               equal_nan=True, rtol=0, atol=0)


def test_compiled_model_saves_without_wrapper_prefixes(tmp_path):
    model = trained_like(build())
    linearize.save_pretrained(torch.compile(model, backend="eager"), tmp_path)
    names = [s["name"] for s in json.loads((tmp_path / CONFIG_NAME).read_text())["sites"]]
    assert names[0] == "relu" and not any("_orig_mod" in n for n in names)


def test_hf_model_round_trip(tmp_path):
    def bert():
        torch.manual_seed(0)
        return hf.BertModel(hf.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, intermediate_size=64)).eval()

    model = linearize.convert(bert())
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.uniform_()
    linearize.save_pretrained(model, tmp_path)
    loaded = linearize.from_pretrained(bert(), tmp_path)
    ids = torch.randint(0, 99, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).last_hidden_state, model(ids).last_hidden_state)


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="converted with linearize.convert"):
        linearize.save_pretrained(build(), tmp_path)
    with pytest.raises(FileNotFoundError, match="no linearize sidecar"):
        linearize.from_pretrained(build(), tmp_path / "missing")
    linearize.save_pretrained(trained_like(build()), tmp_path)
    with pytest.raises(ValueError, match="does not match the saved one"):
        linearize.from_pretrained(build("resnet34"), tmp_path, example_inputs=X)


# ----------------------------------------------------------------------------- a small model for fast checks

XS = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def small() -> nn.Module:
    """Two ReLU units, named "1" (8 channels) and "3" (6 channels)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 6, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(6 * 8 * 8, 5))


def trained_small(seed: int) -> nn.Module:
    """Random slopes in [0, 1) and channels 0, 1 of unit "1" frozen at 1."""
    model = linearize.convert(small(), example_inputs=XS)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.copy_(torch.rand(u.num_channels, generator=gen))
    linearize.units(model)[0][1].freeze_(torch.arange(8) < 2, 1.0)
    return model.eval()


def unit_state(model: nn.Module) -> list:
    return [(n, u.slope.detach().clone(), u.frozen.clone()) for n, u in linearize.units(model)]


def assert_same_units(a: list, b: list) -> None:
    assert [n for n, *_ in a] == [n for n, *_ in b]
    for (_, sa, fa), (_, sb, fb) in zip(a, b):
        torch.testing.assert_close(sa, sb, rtol=0, atol=0)
        torch.testing.assert_close(fa, fb, rtol=0, atol=0, equal_nan=True)


def snapshot(directory) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def manifest(directory) -> dict:
    return json.loads((directory / CONFIG_NAME).read_text())


def tensor_file(directory):
    """The tensor file of a save (format 2 names it in the manifest; format 1 has a fixed name)."""
    weights = manifest(directory).get("weights")
    return directory / (weights["file"] if weights else "linearize_units.safetensors")


# ----------------------------------------------------------------------------- atomic saves


def test_atomic_write_that_fails_midway_leaves_the_target_unchanged(tmp_path, monkeypatch):
    from linearize._files import atomic_write

    target = tmp_path / "f.json"
    target.write_text("old")

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)  # after the bytes went to the temp file, before the rename
    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, "new" * 1000)
    with pytest.raises(OSError):
        atomic_write(tmp_path / "fresh.json", "new")
    monkeypatch.undo()
    assert snapshot(tmp_path) == {"f.json": b"old"}  # no temp files, no half-written fresh.json


@pytest.mark.parametrize("save", ["save_pretrained", "save_folded", "Report.save"])
def test_a_save_onto_a_full_disk_names_the_file_and_keeps_the_previous_save(tmp_path, save):
    """A file-size limit (RLIMIT_FSIZE, as a full disk: writes fail with EFBIG) during a save over an earlier one:
    the OSError names the file being written in that folder and the fix (it named no file), and the folder
    holds the earlier save, every byte unchanged, with no temporary file."""
    import resource

    old, new = trained_small(1), trained_small(2)
    calls = {"save_pretrained": lambda m, d: linearize.save_pretrained(m, d),
             "save_folded": lambda m, d: linearize.save_folded(linearize.fold(m, XS, latency=False), d,
                                                               example_inputs=XS),
             "Report.save": lambda m, d: linearize.report(m, XS, progress=False, skip=["regions"]).save(d)}
    directory = tmp_path / "save"
    calls[save](old, directory)
    before = snapshot(directory)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))  # Python ignores SIGXFSZ: a larger write fails
    try:
        with pytest.raises(OSError, match=r"File too large \(free space on that disk, or save elsewhere; what the "
                                          rf"folder held before is left as it was\): '{re.escape(str(directory))}/") as err:
            calls[save](new, directory)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert err.value.errno == errno.EFBIG and os.path.dirname(err.value.filename) == str(directory)
    assert snapshot(directory) == before


def fail_nth(monkeypatch, name: str, n: int) -> None:
    """Make the ``n``-th call of ``os.<name>`` raise ENOSPC (disk full). A save makes, in order:
    fsync 1 (the tensor file's bytes), replace 1 (its rename into place), fsync 2 (the directory),
    fsync 3 (the manifest's bytes), replace 2 (its rename), fsync 4 (the directory)."""
    calls = []
    real = getattr(os, name)

    def failing(*args):
        calls.append(args)
        if len(calls) == n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)

    monkeypatch.setattr(os, name, failing)


FAILURES = [("replace", 1), ("replace", 2), ("fsync", 1), ("fsync", 2), ("fsync", 3), ("fsync", 4)]
COMMITTED = ("fsync", 4)  # the manifest is renamed in: the new save is complete when this fails


@pytest.mark.parametrize("call, n", FAILURES)
def test_interrupted_save_leaves_the_previous_save_or_the_new_one_never_a_mix(tmp_path, monkeypatch, call, n):
    old, new = trained_small(1), trained_small(2)
    linearize.save_pretrained(old, tmp_path)
    before = snapshot(tmp_path)
    fail_nth(monkeypatch, call, n)
    with pytest.raises(OSError, match="No space left"):
        linearize.save_pretrained(new, tmp_path)
    monkeypatch.undo()
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    loaded = unit_state(linearize.from_pretrained(small(), tmp_path, example_inputs=XS))
    if (call, n) != COMMITTED:  # the previous save, every byte unchanged
        assert snapshot(tmp_path) == before
        assert_same_units(loaded, unit_state(old))
    else:  # the new save, complete
        assert_same_units(loaded, unit_state(new))
        linearize.save_pretrained(new, tmp_path)  # the next save removes the previous tensor file
        assert sorted(snapshot(tmp_path)) == sorted([CONFIG_NAME, tensor_file(tmp_path).name, SAVE_LOCK_NAME])


@pytest.mark.parametrize("failing", ["tensors", "manifest"])
def test_save_whose_writer_fails_keeps_the_previous_save(tmp_path, monkeypatch, failing):
    old = trained_small(1)
    linearize.save_pretrained(old, tmp_path)
    before = snapshot(tmp_path)
    real = serialization.atomic_write

    def writer(path, data):
        if (path.name == CONFIG_NAME) == (failing == "manifest"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(serialization, "atomic_write", writer)
    with pytest.raises(OSError):
        linearize.save_pretrained(trained_small(2), tmp_path)
    assert snapshot(tmp_path) == before
    assert_same_units(unit_state(linearize.from_pretrained(small(), tmp_path, example_inputs=XS)), unit_state(old))


@pytest.mark.parametrize("call, n", [f for f in FAILURES if f != COMMITTED])
def test_failed_first_save_leaves_nothing_that_loads(tmp_path, monkeypatch, call, n):
    fail_nth(monkeypatch, call, n)
    with pytest.raises(OSError):
        linearize.save_pretrained(trained_small(1), tmp_path / "new")
    monkeypatch.undo()
    # the folder stays, with its (empty) save lock only: removing it could pull it from under a waiting save
    assert [p.name for p in (tmp_path / "new").iterdir()] == [SAVE_LOCK_NAME]
    with pytest.raises(FileNotFoundError, match="no linearize sidecar"):
        linearize.from_pretrained(small(), tmp_path / "new", example_inputs=XS)
    (tmp_path / "kept").mkdir()  # a directory that existed before is kept, and left empty but for the lock
    fail_nth(monkeypatch, call, n)
    with pytest.raises(OSError):
        linearize.save_pretrained(trained_small(1), tmp_path / "kept")
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "kept").iterdir()] == [SAVE_LOCK_NAME]


def test_save_killed_after_writing_the_tensors_still_loads_the_previous_save(tmp_path):
    """A hard kill runs no clean-up: what it leaves (the new tensor file, the partial temp file of a tensor file
    killed while written, a temp manifest) must not change what loads, and the next save removes it (as
    docs/saving.md says)."""
    old, directory, other = trained_small(1), tmp_path / "model", tmp_path / "other"
    linearize.save_pretrained(old, directory)
    linearize.save_pretrained(trained_small(2), other)
    orphan = tensor_file(other)
    (directory / orphan.name).write_bytes(orphan.read_bytes())
    (directory / f".{CONFIG_NAME}.0123456789ab.tmp").write_text('{"format"')
    (directory / f".{orphan.name}.ba9876543210.tmp").write_bytes(orphan.read_bytes()[:100])
    assert_same_units(unit_state(linearize.from_pretrained(small(), directory, example_inputs=XS)), unit_state(old))
    (directory / "model.safetensors").write_bytes(b"not ours")  # the base model's files are left alone
    linearize.save_pretrained(old, directory)
    assert sorted(snapshot(directory)) == sorted([CONFIG_NAME, tensor_file(directory).name, "model.safetensors",
                                                  SAVE_LOCK_NAME])


def test_reader_racing_a_save_loads_the_new_pair(tmp_path, monkeypatch):
    """A save completes between the reader's manifest read and its tensor read (the old tensor file is
    gone): the reader reads the new manifest again instead of failing or mixing."""
    new = trained_small(2)
    linearize.save_pretrained(trained_small(1), tmp_path)
    real = serialization._parse_manifest
    calls = []

    def parse_then_save(raw, path):
        meta = real(raw, path)
        if not calls:
            linearize.save_pretrained(new, tmp_path)
        calls.append(path)
        return meta

    monkeypatch.setattr(serialization, "_parse_manifest", parse_then_save)
    loaded = linearize.from_pretrained(small(), tmp_path, example_inputs=XS)
    assert len(calls) == 2
    assert_same_units(unit_state(loaded), unit_state(new))


def test_save_refuses_a_state_that_would_not_load_back(tmp_path):
    model = trained_small(1)
    with torch.no_grad():
        linearize.units(model)[1][1].slope[2] = 1.5  # set by hand, never projected
    with pytest.raises(ValueError, match=r"cannot save unit '3': slope 1.5 at channel 2 lies outside \[0, 1\]"):
        linearize.save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    linearize.project_slopes(model)
    linearize.save_pretrained(model, tmp_path / "out")


# ----------------------------------------------------------------------------- validated loads


def to_format(directory, fmt: int) -> None:
    """Turn a save into a sidecar of an older format, as older versions wrote: the units only (no model
    weights, no ``base``); format 1 also has a fixed tensor file name and no checksum."""
    meta = manifest(directory)
    path = tensor_file(directory)
    tensors = {k: t for k, t in safetensors.torch.load(path.read_bytes()).items()
               if not k.startswith(serialization.MODEL_PREFIX)}
    path.unlink()
    data = safetensors.torch.save(tensors)
    del meta["base"]
    if fmt == 1:
        del meta["weights"]
        path = directory / "linearize_units.safetensors"
    else:
        digest = hashlib.sha256(data).hexdigest()
        path = directory / f"linearize_units-{digest[:16]}.safetensors"
        meta["weights"] = {"file": path.name, "bytes": len(data), "sha256": digest}
    meta["format"] = fmt
    path.write_bytes(data)
    (directory / CONFIG_NAME).write_text(json.dumps(meta))


def rewrite_tensors(directory, edit) -> None:
    """Apply ``edit`` to the saved tensors and rewrite the pair consistently (new checksum, as another
    tool would), so only the checks of the values can catch the change."""
    path = tensor_file(directory)
    tensors = safetensors.torch.load(path.read_bytes())
    edit(tensors)
    data = safetensors.torch.save(tensors)
    meta = manifest(directory)
    if "weights" in meta:
        digest = hashlib.sha256(data).hexdigest()
        path.unlink()
        path = directory / f"linearize_units-{digest[:16]}.safetensors"
        meta["weights"] = {"file": path.name, "bytes": len(data), "sha256": digest}
        (directory / CONFIG_NAME).write_text(json.dumps(meta))
    path.write_bytes(data)


def setitem(key, value):
    return lambda tensors: tensors.__setitem__(key, value)


def set_value(key, index, value):
    return lambda tensors: tensors[key].__setitem__(index, value)


TAMPERED = {  # edit of the saved tensors -> what the error says (unit "3" has 6 channels)
    "slope 5": (set_value("3.slope", 4, 5.0), r"unit '3': slope 5.0 at channel 4 lies outside \[0, 1\]"),
    "slope -3": (set_value("3.slope", 0, -3.0), r"unit '3': slope -3.0 at channel 0 lies outside \[0, 1\]"),
    "slope NaN": (set_value("3.slope", 1, float("nan")),
                  r"unit '3': slope holds 1 non-finite value\(s\), e.g. nan at channel 1"),
    "slope inf": (set_value("1.slope", 5, float("inf")), r"unit '1': slope holds 1 non-finite value\(s\)"),
    "slope int64": (setitem("3.slope", torch.ones(6, dtype=torch.int64)),
                    r"unit '3': slope has dtype torch.int64, expected a floating"),
    "slope shape": (setitem("3.slope", torch.rand(7)), r"unit '3': slope has shape \(7,\), expected \(6,\)"),
    "frozen 0.5": (set_value("3.frozen", 3, 0.5),
                   r"unit '3': frozen value 0.5 at channel 3: a frozen channel holds 0 or 1"),
    "frozen off its slope": (set_value("1.slope", 0, 0.25),
                             r"unit '1': channel 0 is frozen at 1 but its slope is 0.25"),
    "frozen bool": (setitem("1.frozen", torch.zeros(8, dtype=torch.bool)), r"unit '1': frozen has dtype torch.bool"),
    "missing key": (lambda t: t.pop("3.slope"), r"unit '3' has no 'slope' tensor \(3.slope\)"),
    "extra key": (setitem("5.slope", torch.zeros(3)), r"tensors \['5.slope'\] belong to no unit"),
}


@pytest.mark.parametrize("fmt", [1, 3])
@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_load_refuses_tampered_unit_tensors(tmp_path, case, fmt):
    edit, message = TAMPERED[case]
    linearize.save_pretrained(trained_small(1), tmp_path)
    if fmt == 1:
        to_format(tmp_path, 1)
    rewrite_tensors(tmp_path, edit)
    base = small()
    with pytest.raises(ValueError, match=message) as err:
        linearize.from_pretrained(base, tmp_path, example_inputs=XS)
    assert isinstance(err.value, linearize.LoadError)
    assert str(tensor_file(tmp_path)) in str(err.value) and "save_pretrained" in str(err.value)
    assert linearize.units(base) == []  # refused before the model was converted


@pytest.mark.parametrize("fmt", [1, 2])
def test_older_sidecars_still_load_their_units_onto_the_model_with_a_warning(tmp_path, fmt):
    """Formats 1 and 2 hold the units only: they load onto the weights the model has, saying so."""
    model = trained_small(1)
    linearize.save_pretrained(model, tmp_path)
    to_format(tmp_path, fmt)
    with pytest.warns(serialization.UnitsOnlyWarning,
                      match=rf"holds the units only \(written by an older linearize, sidecar format {fmt}\).*"
                            r"load those first \(model.load_state_dict\)"):
        loaded = linearize.from_pretrained(small(), tmp_path, example_inputs=XS)
    assert_same_units(unit_state(loaded), unit_state(model))
    with torch.no_grad():
        assert torch.equal(loaded(XS), model(XS))  # small() is the same seeded base


def flip_bit_in(key: str):
    """Flip the lowest bit of the first element of tensor ``key`` (the slope moves by one ulp: still
    in [0, 1], so only a checksum can tell)."""

    def flip(path) -> None:
        raw = bytearray(path.read_bytes())
        n = int.from_bytes(raw[:8], "little")
        start = json.loads(raw[8:8 + n])[key]["data_offsets"][0]
        raw[8 + n + start] ^= 1
        path.write_bytes(bytes(raw))

    return flip


def truncate(path) -> None:
    path.write_bytes(path.read_bytes()[:-5])


DAMAGED_TENSOR_FILE = {  # damage to the tensor file, the manifest untouched -> what the error says
    "bit flip": (flip_bit_in("3.slope"), r"does not match the SHA-256 recorded at save time \(changed: 3.slope\)"),
    "bit flip in a weight": (flip_bit_in("__linearize_model__.5.weight"),
                             r"does not match the SHA-256 .*\(changed: __linearize_model__.5.weight\)"),
    "truncated": (truncate, r"has \d+ bytes, linearize_config.json recorded \d+ at save time \(truncated\?\)"),
    "missing": (lambda p: p.unlink(), r"is missing, though linearize_config.json names it"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED_TENSOR_FILE))
def test_load_refuses_a_damaged_tensor_file(tmp_path, case):
    damage, message = DAMAGED_TENSOR_FILE[case]
    linearize.save_pretrained(trained_small(1), tmp_path)
    path = tensor_file(tmp_path)
    damage(path)
    base = small()
    with pytest.raises(ValueError, match=message) as err:
        linearize.from_pretrained(base, tmp_path, example_inputs=XS)
    assert isinstance(err.value, linearize.LoadError) and str(path) in str(err.value)
    assert linearize.units(base) == []


def test_load_refuses_a_truncated_format_1_tensor_file(tmp_path):
    linearize.save_pretrained(trained_small(1), tmp_path)
    to_format(tmp_path, 1)
    path = tensor_file(tmp_path)
    truncate(path)
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": not a readable safetensors file") as err:
        linearize.from_pretrained(small(), tmp_path, example_inputs=XS)
    assert isinstance(err.value, linearize.LoadError)


def edit_manifest(edit):
    def apply(path) -> None:
        meta = json.loads(path.read_text())
        edit(meta)
        path.write_text(json.dumps(meta))

    return apply


TAMPERED_MANIFEST = {  # damage to linearize_config.json -> what the error says
    "empty": (lambda p: p.write_text(""), r"the file is empty"),
    "cut short": (lambda p: p.write_text(p.read_text()[:40]), r"not valid JSON"),
    "not an object": (lambda p: p.write_text("[1, 2]"), r"expected a JSON object, got list"),
    "no sites": (edit_manifest(lambda m: m.pop("sites")), r"missing 'sites'"),
    "bad config": (edit_manifest(lambda m: m["config"].update(mode="gelu")), r"invalid 'config' \(mode must be one of"),
    "bad site": (edit_manifest(lambda m: m["sites"][0].update(num_channels="8")), r"'sites' must be a list"),
    "path in weights": (edit_manifest(lambda m: m["weights"].update(file="../../etc/passwd")), r"'weights' must be"),
    "future format": (edit_manifest(lambda m: m.update(format=99)), r"unsupported sidecar format 99"),
    "no base": (edit_manifest(lambda m: m.pop("base")), r"'base' must be \{saved: true\}"),
    "bad base": (edit_manifest(lambda m: m.update(base={"saved": "yes"})), r"'base' must be"),
    "bad supersedes": (edit_manifest(lambda m: m.update(supersedes=["model.safetensors"])), r"'supersedes' must be"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED_MANIFEST))
def test_load_refuses_a_damaged_manifest(tmp_path, case):
    damage, message = TAMPERED_MANIFEST[case]
    linearize.save_pretrained(trained_small(1), tmp_path)
    damage(tmp_path / CONFIG_NAME)
    base = small()
    with pytest.raises(ValueError, match=message) as err:
        linearize.from_pretrained(base, tmp_path, example_inputs=XS)
    assert isinstance(err.value, linearize.LoadError) and str(tmp_path / CONFIG_NAME) in str(err.value)
    assert linearize.units(base) == []


def test_gated_load_refuses_tensors_that_do_not_fit_the_model(tmp_path):
    linearize.save_pretrained(linearize.convert(small(), mode="dgn", example_inputs=XS), tmp_path)
    rewrite_tensors(tmp_path, lambda t: t.pop("value.0.weight"))
    with pytest.raises(ValueError, match=re.escape(str(tensor_file(tmp_path))) +
                       r": the saved gated model does not match the rebuilt one \(missing \['value.0.weight'\]") as err:
        linearize.from_pretrained(small(), tmp_path, example_inputs=XS)
    assert isinstance(err.value, linearize.LoadError)
    rewrite_tensors(tmp_path, lambda t: t.__setitem__("value.0.weight", torch.zeros(8, 3, 1, 1)))
    with pytest.raises(ValueError, match=r"tensor 'value.0.weight' is torch.float32 \(8, 3, 1, 1\), the model "
                       r"expects torch.float32 \(8, 3, 3, 3\)"):
        linearize.from_pretrained(small(), tmp_path, example_inputs=XS)


def test_load_unit_tensors_reads_a_save_without_a_model(tmp_path):
    model = trained_small(1)
    linearize.save_pretrained(model, tmp_path)
    tensors = serialization.load_unit_tensors(tmp_path)
    assert sorted(tensors) == ["1.frozen", "1.slope", "3.frozen", "3.slope"]
    assert_same_units([(n, tensors[f"{n}.slope"], tensors[f"{n}.frozen"]) for n in ("1", "3")], unit_state(model))
    rewrite_tensors(tmp_path, set_value("3.slope", 0, 2.0))
    with pytest.raises(ValueError, match=r"unit '3': slope 2.0 at channel 0 lies outside \[0, 1\]"):
        serialization.load_unit_tensors(tmp_path)


# ----------------------------------------------------------------------------- the model's own weights


def test_a_fresh_model_gets_the_saved_weights_not_only_the_slopes(tmp_path):
    """A save of a model that is not a Hugging Face model holds its weights: loaded into a freshly built
    model (other random weights), the outputs are those of the saved model, not the saved slopes on the
    fresh weights (logits 13.8 off before)."""
    model = trained_like(build())
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        truth = model(x)  # before saving
    linearize.save_pretrained(model, tmp_path)
    torch.manual_seed(7)
    fresh = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    with torch.no_grad():
        assert not torch.equal(fresh.fc.weight, model.fc.weight)
    loaded = linearize.from_pretrained(fresh, tmp_path, example_inputs=X)
    assert loaded is fresh
    with torch.no_grad():
        assert torch.equal(loaded(x), truth)
    assert manifest(tmp_path)["base"] == {"saved": True} and manifest(tmp_path)["format"] == 3


def test_weights_of_another_shape_are_refused_before_they_are_loaded(tmp_path):
    """Same units (sites), other head: the saved weights do not fit the model given."""
    linearize.save_pretrained(trained_small(1), tmp_path)
    other = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 6, 3, padding=1), nn.ReLU(),
                          nn.Flatten(), nn.Linear(6 * 8 * 8, 7))
    with pytest.raises(linearize.LoadError, match=r"tensor '5\.(weight|bias)' is torch.float32 \(5,.*\), the model "
                                                  r"expects torch.float32 \(7,.*Build the same architecture"):
        linearize.from_pretrained(other, tmp_path, example_inputs=XS)
    with pytest.raises(linearize.LoadError, match=r"the saved model does not match the rebuilt one \(missing "
                                                  r"\['4.bias', '4.weight', '6.bias', '6.weight'\], "
                                                  r"unexpected \['5.bias', '5.weight'\]\)"):
        linearize.from_pretrained(nn.Sequential(*small()[:4], nn.Conv2d(6, 6, 1), nn.Flatten(),
                                                nn.Linear(6 * 8 * 8, 5)), tmp_path, example_inputs=XS)


def _bert(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return hf.BertModel(hf.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64)).eval()


def test_sidecar_of_a_hf_model_refuses_a_model_with_other_weights(tmp_path):
    """A Hugging Face model's sidecar with ``weights=False`` holds its units and their weights' digests (the
    weights go in its own save_pretrained): loaded into a model with other weights (and no HF save in the
    folder), it is refused, naming the fix; into the model it was saved from (or a float64 copy: same
    values), it loads exactly. (The default save keeps the weights: tests/test_hf_save.py.)"""
    model = linearize.convert(_bert(0))
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.uniform_()
    ids = torch.randint(0, 99, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        truth = model(ids).last_hidden_state
    linearize.save_pretrained(model, tmp_path, weights=False)
    with pytest.raises(linearize.LoadError, match=r"the weights of the BertModel given are not those the units were "
                                                  r"saved with \(\d+ of them differ.*model.save_pretrained"):
        linearize.from_pretrained(_bert(1), tmp_path)
    assert not any(k.startswith(serialization.MODEL_PREFIX) for k in serialization.load_unit_tensors(tmp_path))
    with torch.no_grad():
        assert torch.equal(linearize.from_pretrained(_bert(0), tmp_path)(ids).last_hidden_state, truth)
        wide = linearize.from_pretrained(_bert(0).double(), tmp_path)(ids).last_hidden_state
    torch.testing.assert_close(wide, truth.double(), rtol=1e-5, atol=1e-5)


def test_sidecar_of_a_hf_head_model_checks_the_weights_its_base_model_shares(tmp_path):
    """Units of a masked-LM saved as a sidecar, loaded into its base class: the base model's weights are checked
    against those the head model's base had (its prefix removed); the head's own are not the base model's."""
    config = hf.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64)
    torch.manual_seed(0)
    mlm = hf.BertForMaskedLM(config).eval()
    own = {k[len("bert."):]: v.clone() for k, v in mlm.state_dict().items() if k.startswith("bert.")}
    linearize.convert(mlm)
    with torch.no_grad():
        for _, u in linearize.units(mlm):
            u.slope.uniform_()
    ids = torch.randint(0, 99, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        truth = mlm.bert(ids).last_hidden_state
    linearize.save_pretrained(mlm, tmp_path, weights=False)
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="saved unit"), pytest.raises(
            linearize.LoadError, match=r"the weights of the BertModel given are not those the units"):
        linearize.from_pretrained(hf.BertModel(config, add_pooling_layer=False).eval(), tmp_path)
    base = hf.BertModel(config, add_pooling_layer=False).eval()
    base.load_state_dict(own)
    with pytest.warns(UserWarning, match="saved unit"):  # the head's unit is not in the base model
        loaded = linearize.from_pretrained(base, tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(ids).last_hidden_state, truth)


class Scaled(nn.Module):
    """A layer whose calibrated ``scale`` is extra state (get_extra_state), not a tensor."""

    def __init__(self, scale=1.0) -> None:
        super().__init__()
        self.lin, self.scale = nn.Linear(4, 8), scale

    def get_extra_state(self):
        return {"scale": self.scale}

    def set_extra_state(self, state) -> None:
        self.scale = state["scale"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale["factor"] if isinstance(self.scale, dict) else self.lin(x) * self.scale


def _scaled(mode: str = "prelu", scale=1.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Scaled(scale), nn.ReLU(), nn.Linear(8, 3))
    return linearize.convert(model, mode=mode, example_inputs=torch.randn(2, 4))


@pytest.mark.parametrize("mode", ["prelu", "dgn"])
def test_extra_state_of_a_module_loads_back_as_torch_state_dict_does(tmp_path, mode):
    """A module's non-tensor extra state was left out of the save and the load kept the fresh model's (scale 1.0,
    outputs 0.67 off, no word; dgn crashed with AttributeError). Truth: torch's own state_dict round trip."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    model = _scaled(mode, {"factor": 3.0})
    torch_copy = _scaled(mode)
    torch_copy.load_state_dict(model.state_dict())
    linearize.save_pretrained(model, tmp_path)
    loaded = linearize.from_pretrained(nn.Sequential(Scaled(), nn.ReLU(), nn.Linear(8, 3)), tmp_path,
                                       example_inputs=torch.randn(2, 4))
    with torch.no_grad():
        assert torch.equal(loaded(x), torch_copy(x)) and torch.equal(loaded(x), model(x))
    scales = [[m.scale for m in net.modules() if isinstance(m, Scaled)] for net in (loaded, torch_copy)]
    assert scales[0] == scales[1] and {"factor": 3.0} in scales[0]


def test_extra_state_that_is_not_json_data_is_refused_naming_the_module(tmp_path):
    for scale in ((1.0, 2.0), {1: 2.0}, object()):  # a tuple and int keys read back as other values
        model = _scaled()
        model[0].scale = scale
        with pytest.raises(ValueError, match=r"extra state of module '0' \(Scaled\).*not plain JSON data"):
            linearize.save_pretrained(model, tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_save_without_the_extra_state_the_model_holds_is_refused(tmp_path):
    linearize.save_pretrained(_scaled(scale=3.0), tmp_path)
    meta = manifest(tmp_path)
    del meta["extra_state"]  # as a save before the extra state was kept
    (tmp_path / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(linearize.LoadError, match=r"linearize_config.json: the model holds extra state "
                                                  r"\(get_extra_state\) \['0._extra_state'\], the save \[\]"):
        linearize.from_pretrained(nn.Sequential(Scaled(), nn.ReLU(), nn.Linear(8, 3)), tmp_path,
                                  example_inputs=torch.randn(2, 4))


class _WeightLoop(nn.Module):
    """Three layers held as a ParameterList and one activation (functional, or a module) looped over them. With
    ``unrolled`` the three calls come from three lines, which convert gives one unit each: the layout (names and
    tensors) that linearize wrote for the loop before it gave a loop over weights one shared unit."""

    def __init__(self, functional: bool, unrolled: bool = False) -> None:
        super().__init__()
        self.ws = nn.ParameterList(nn.Parameter(torch.randn(8, 8) / 3) for _ in range(3))
        self.act, self.unrolled = None if functional else nn.ReLU(), unrolled

    def forward(self, x):
        act = torch.nn.functional.relu if self.act is None else self.act
        if self.unrolled:
            x = act(x @ self.ws[0])
            x = act(x @ self.ws[1])
            return act(x @ self.ws[2])
        for w in self.ws:
            x = act(x @ w)
        return x


@pytest.mark.parametrize("functional", [True, False])
def test_a_save_with_one_unit_per_loop_iteration_is_refused_naming_the_layout_change(tmp_path, functional):
    """A loop over weights saved by the earlier version (one unit per iteration) was refused with 'Build the same
    architecture' though the model is the same: the error now names the per-iteration save, this version's shared
    unit and the fix. The save itself is sound: a model converted into that layout loads it."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    old = linearize.convert(_WeightLoop(functional, unrolled=True), example_inputs=x)
    assert len(linearize.units(old)) == 3
    linearize.save_pretrained(old, tmp_path)
    with pytest.raises(ValueError, match=r"holds one unit per iteration of a loop.*earlier linearize version.*one "
                                         r"shared unit.*Fix: convert the original model again.*version that wrote it"):
        linearize.from_pretrained(_WeightLoop(functional), tmp_path, example_inputs=x)
    linearize.from_pretrained(_WeightLoop(functional, unrolled=True), tmp_path, example_inputs=x)
