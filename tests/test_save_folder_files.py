"""Loading from a save folder whose files are not what a save wrote: JSON nested too deep, a tensor file that is
a link to a device, a FIFO or larger than recorded, a Hugging Face save older or newer than the sidecar beside it,
and a folded save replaced while it is read. Each is refused with a LoadError naming the file, at once, or loads the
model last saved."""

from __future__ import annotations

import json
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
from linearize.deploy import FOLDED_CONFIG
from linearize.serialization import CONFIG_NAME

DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON that Python's parser cannot nest into


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    linearize.convert(model, example_inputs=torch.randn(1, 4))
    with torch.no_grad():
        for _, unit in linearize.units(model):
            unit.slope.fill_(0.5)
    return model


def _fresh() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _tensor_file(directory: Path) -> Path:
    return directory / json.loads((directory / CONFIG_NAME).read_text())["weights"]["file"]


def test_json_nested_too_deep_is_a_load_error_naming_the_file(tmp_path):
    model = _mlp()
    linearize.save_pretrained(model, tmp_path / "units")
    (tmp_path / "units" / CONFIG_NAME).write_text(DEEP)
    with pytest.raises(linearize.LoadError, match=rf"{CONFIG_NAME}: not valid JSON.*nests deeper"):
        linearize.from_pretrained(_fresh(), tmp_path / "units", example_inputs=torch.randn(1, 4))
    linearize.save_folded(linearize.fold(_mlp(), torch.randn(8, 4)), tmp_path / "folded")
    (tmp_path / "folded" / FOLDED_CONFIG).write_text(DEEP)
    with pytest.raises(linearize.LoadError, match=rf"{FOLDED_CONFIG}: not a folded-model description"):
        linearize.load_folded(tmp_path / "folded")


def test_json_holding_an_integer_too_long_for_python_is_a_load_error_naming_the_file(tmp_path):
    """An integer of more than 4,300 digits (Python's int-string limit; a bare ValueError naming no file) in the
    sidecar's config or folded.json: refused like any other damaged JSON, naming the file."""
    model = _mlp()
    linearize.save_pretrained(model, tmp_path / "units")
    config = tmp_path / "units" / CONFIG_NAME
    config.write_text(config.read_text().replace('"format": ', '"format": ' + "9" * 5000 + ", \"was\": ", 1))
    with pytest.raises(linearize.LoadError, match=rf"{config}: not valid JSON for this reader: it holds an integer "
                                                  r"of more than 4,300 digits; a damaged"):
        linearize.from_pretrained(_fresh(), tmp_path / "units", example_inputs=torch.randn(1, 4))
    linearize.save_folded(linearize.fold(_mlp(), torch.randn(8, 4)), tmp_path / "folded")
    folded = tmp_path / "folded" / FOLDED_CONFIG
    folded.write_text(folded.read_text().replace('"format": ', '"format": ' + "9" * 5000 + ", \"was\": ", 1))
    with pytest.raises(linearize.LoadError, match=rf"{folded}: not a folded-model description"):
        linearize.load_folded(tmp_path / "folded")


def test_an_hf_config_nested_too_deep_is_no_manifest(tmp_path):
    from linearize import hf

    (tmp_path / "config.json").write_text(DEEP)
    assert hf.has_manifest(tmp_path) is False


_LOAD = """
import sys, torch, linearize
from torch import nn
try:
    linearize.from_pretrained(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), sys.argv[1],
                              example_inputs=torch.randn(1, 4))
    print("loaded")
except linearize.LoadError as err:
    print("LoadError", err)
"""


@pytest.mark.parametrize("swap", ["link to /dev/zero", "fifo", "grown"])
def test_a_tensor_file_that_is_no_file_of_the_recorded_size_is_refused_without_reading_it(tmp_path, swap):
    """Run in a child with a time limit: the tensor file used to be read whole first (a link to /dev/zero read
    until memory ran out, a FIFO blocked forever)."""
    directory = tmp_path / "units"
    linearize.save_pretrained(_mlp(), directory)
    tensors = _tensor_file(directory)
    if swap == "grown":
        with open(tensors, "ab") as f:
            f.write(b"\0" * 10_000)
    else:
        tensors.unlink()
        os.symlink("/dev/zero", tensors) if swap == "link to /dev/zero" else os.mkfifo(tensors)
    env = dict(os.environ, LINEARIZE_CPU_KERNEL="0", PYTHONPATH=str(Path(linearize.__file__).parents[1]))
    out = subprocess.run([sys.executable, "-c", _LOAD, str(directory)], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.stdout.startswith("LoadError"), out.stdout + out.stderr[-2000:]
    assert tensors.name in out.stdout and "refusing to load it" in out.stdout


def _tiny_bert(transformers) -> tuple[object, torch.Tensor, nn.Module]:
    """``(config, input ids, converted model)``: a two-layer BERT built from a config, converted."""
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32)
    ids = torch.randint(0, 50, (2, 7))
    torch.manual_seed(0)
    return config, ids, linearize.convert(transformers.BertModel(config).eval(), example_inputs={"input_ids": ids})


def _trained_further(model: nn.Module, weights: bool = True) -> None:
    """Training after a save: the weights (unless ``weights=False``) and every unit's slopes change."""
    with torch.no_grad():
        if weights:
            model.encoder.layer[0].output.dense.weight.add_(0.1)
        for _, unit in linearize.units(model):
            unit.slope.add_(0.25)


@pytest.mark.parametrize("order", ["converted model saved first", "base saved before conversion",
                                   "only the slopes trained since"])
def test_a_sidecar_saved_after_an_older_hf_save_keeps_what_gets_the_model_back(tmp_path, order):
    """model.save_pretrained(d) (a Trainer save, or the fine-tuned base before conversion), further training, then
    linearize.save_pretrained(model, d) only: the sidecar used to record the digests of the newer weights alone,
    so they were on no disk, and every load was refused. It keeps them now (or, when only the slopes changed, the
    folder's weights are the model's: their digests), and the class and an instance load the model last saved."""
    transformers = pytest.importorskip("transformers")
    config, ids, model = _tiny_bert(transformers)
    if order == "base saved before conversion":
        torch.manual_seed(0)
        base = transformers.BertModel(config).eval()
        base.save_pretrained(tmp_path)
        model = linearize.convert(base, example_inputs={"input_ids": ids})
    else:
        model.save_pretrained(tmp_path)
    _trained_further(model, weights=order != "only the slopes trained since")
    expected = model(input_ids=ids).last_hidden_state
    linearize.save_pretrained(model, tmp_path)  # only the sidecar
    saved = json.loads((tmp_path / CONFIG_NAME).read_text())["base"]["saved"]
    assert saved is (order != "only the slopes trained since")
    for load in (lambda: linearize.from_pretrained(transformers.BertModel, tmp_path),
                 lambda: linearize.from_pretrained(transformers.BertModel(config), tmp_path,
                                                   example_inputs={"input_ids": ids})):
        assert torch.equal(load().eval()(input_ids=ids).last_hidden_state, expected)
    if order == "converted model saved first":  # a newer HF save beside that sidecar: one of them is stale
        _trained_further(model)
        model.save_pretrained(tmp_path)
        with pytest.raises(linearize.LoadError, match="one of them is stale"):
            linearize.from_pretrained(transformers.BertModel, tmp_path)


def test_a_sidecar_beside_the_hf_save_of_the_same_weights_holds_their_digests(tmp_path):
    transformers = pytest.importorskip("transformers")
    config, ids, model = _tiny_bert(transformers)
    model.save_pretrained(tmp_path)
    linearize.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / CONFIG_NAME).read_text())["base"]["saved"] is False
    expected = model(input_ids=ids).last_hidden_state
    loaded = linearize.from_pretrained(transformers.BertModel, tmp_path).eval()
    assert torch.equal(loaded(input_ids=ids).last_hidden_state, expected)
    half = linearize.from_pretrained(transformers.BertModel, tmp_path, dtype=torch.bfloat16)
    assert half.embeddings.word_embeddings.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_older_hf_weights_under_a_sidecar_of_their_digests_are_refused_in_every_dtype(tmp_path, dtype):
    """The sidecar records the digests of weights the folder's model.safetensors does not hold (saved with
    weights=False after more training): the load was refused in float32 but gave the older weights under the
    newer units in half precision, where the model's cast tensors were left out of the comparison."""
    transformers = pytest.importorskip("transformers")
    config, ids, model = _tiny_bert(transformers)
    model.save_pretrained(tmp_path)
    _trained_further(model)
    linearize.save_pretrained(model, tmp_path, weights=False)
    for load in (lambda: linearize.from_pretrained(transformers.BertModel, tmp_path, dtype=dtype),
                 lambda: linearize.from_pretrained(transformers.BertModel(config).to(dtype), tmp_path,
                                                   example_inputs={"input_ids": ids})):
        with pytest.raises(linearize.LoadError, match=r"Hugging Face weights in .* are not those the units were "
                                                      r"saved with.*encoder\.layer\.0\.output\.dense\.weight"):
            load()


def test_load_folded_while_another_thread_saves_into_the_folder_gives_a_saved_model(tmp_path):
    """A save replaces folded.json and removes the weights file it named while a load reads them: the load
    reads the pair again, and gives one of the saved models (it raised FileNotFoundError in that window)."""
    x = torch.randn(8, 4)
    models = [linearize.fold(_mlp(seed), x) for seed in range(3)]
    truths = [m(x) for m in models]
    linearize.save_folded(models[0], tmp_path, example_inputs=x[:1])
    stop = threading.Event()
    saved: list[int] = []

    def saver() -> None:
        while not stop.is_set():
            linearize.save_folded(models[len(saved) % 3], tmp_path, example_inputs=x[:1])
            saved.append(1)

    thread = threading.Thread(target=saver)
    thread.start()
    loads, deadline = 0, time.monotonic() + 6
    try:
        while time.monotonic() < deadline:
            out = linearize.load_folded(tmp_path, check=False)(x)
            assert any(torch.equal(out, t) for t in truths)
            loads += 1
    finally:
        stop.set()
        thread.join(timeout=60)
    assert loads > 5 and len(saved) > 5


def test_a_sidecar_older_than_the_hf_save_beside_it_is_refused(tmp_path):
    """The mirror case: linearize.save_pretrained(model, d) first (it holds every weight), further training,
    then model.save_pretrained(d) (a Trainer save). The older sidecar's weights used to replace the newer ones."""
    transformers = pytest.importorskip("transformers")
    config, ids, model = _tiny_bert(transformers)
    linearize.save_pretrained(model, tmp_path)
    with torch.no_grad():
        model.encoder.layer[1].intermediate.dense.bias.add_(0.1)
    model.save_pretrained(tmp_path)
    with pytest.raises(linearize.LoadError, match=r"hold different weights .*encoder\.layer\.1\.intermediate\.dense"
                                                  r"\.bias.*one of them is stale"):
        linearize.from_pretrained(transformers.BertModel, tmp_path)
    linearize.save_pretrained(model, tmp_path)  # both saved from the model in memory: the pair loads
    loaded = linearize.from_pretrained(transformers.BertModel, tmp_path).eval()
    assert torch.equal(loaded(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)


def test_wrong_model_arguments_and_loaders_are_refused_naming_the_fix(tmp_path):
    """A builder function instead of the model it builds, a save into a path that is a file, and each loader
    given the other's folder: errors that name the input and the fix (they were bare AttributeErrors, a
    'File exists' or a 'no linearize sidecar')."""
    import torchvision

    net = linearize.convert(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), example_inputs=torch.randn(2, 3))
    sidecar, folded, file = tmp_path / "sidecar", tmp_path / "folded", tmp_path / "notes.txt"
    linearize.save_pretrained(net, sidecar)
    linearize.save_folded(net, folded, example_inputs=torch.randn(2, 3))
    file.write_text("")
    with pytest.raises(TypeError, match=r"resnet18\(\)"):
        linearize.from_pretrained(torchvision.models.resnet18, sidecar)
    with pytest.raises(TypeError, match="nn.Module"):
        linearize.from_pretrained(None, sidecar)
    with pytest.raises(FileNotFoundError, match="load_folded"):
        linearize.from_pretrained(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), folded)
    with pytest.raises(FileNotFoundError, match="from_pretrained"):
        linearize.load_folded(sidecar)
    for save in (lambda d: linearize.save_pretrained(net, d), lambda d: linearize.save_folded(net, d)):
        with pytest.raises(NotADirectoryError, match="notes.txt is a file"):
            save(file)
    assert file.read_text() == ""


def test_an_hf_folder_with_a_stray_link_loop_loads(tmp_path):
    """A link loop beside the files (a bad sync) that transformers never reads made the load die with a bare
    RuntimeError 'Symlink loop': the folder loads, with the saved outputs."""
    transformers = pytest.importorskip("transformers")
    _, ids, model = _tiny_bert(transformers)
    model.save_pretrained(tmp_path)
    (tmp_path / "notes.txt").symlink_to("notes.txt")  # links to itself
    loaded = linearize.from_pretrained(transformers.BertModel, tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)


_SHARD_FIFO = """
import os, sys, json, torch, transformers, linearize
directory, ids = sys.argv[1], torch.randint(0, 50, (2, 7))
config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=32, max_position_embeddings=32)
model = linearize.convert(transformers.BertModel(config).eval(), example_inputs={"input_ids": ids})
model.save_pretrained(directory, max_shard_size="20KB")
index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
shard = os.path.join(directory, next(v for k, v in index["weight_map"].items() if k.endswith(".slope")))
os.remove(shard)
os.mkfifo(shard)  # a download tool's pipe left in place of a shard
for load in (lambda: linearize.from_pretrained(transformers.BertModel, directory),
             lambda: linearize.from_pretrained(transformers.BertModel(config), directory)):
    try:
        load()
        print("loaded")
    except linearize.LoadError as err:
        print("LoadError", err)
linearize.save_pretrained(model, directory)  # the shards hold nothing of the model: the sidecar keeps the weights
print("saved")
"""


def test_a_fifo_among_the_weight_shards_of_an_hf_save_is_refused_without_reading_it(tmp_path):
    """Run in a child with a time limit: the shards were opened with safetensors.safe_open, which waited forever on
    a FIFO (both loads, and save_pretrained, which reads the folder's weights)."""
    pytest.importorskip("transformers")
    env = dict(os.environ, LINEARIZE_CPU_KERNEL="0", PYTHONPATH=str(Path(linearize.__file__).parents[1]))
    out = subprocess.run([sys.executable, "-c", _SHARD_FIFO, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=env)
    lines = out.stdout.splitlines()
    assert len(lines) == 3, out.stdout + out.stderr[-2000:]
    for line in lines[:2]:
        assert line.startswith("LoadError") and ".safetensors is not a regular file (a FIFO" in line, line
    assert lines[2] == "saved"


def test_odd_entries_where_a_save_or_load_expects_a_file_or_folder_are_named_with_the_fix(tmp_path):
    """A folder where a save writes its JSON file, a FIFO or folder where a load reads one, a save folder that is a
    link to nothing or a loop of links: errors naming the path, what is wrong and the fix (they were a bare
    IsADirectoryError about a hidden temp file, 'File exists', ELOOP, or 'has no linearize sidecar')."""
    model = _mlp()
    x = torch.randn(8, 4)
    for name, save in [(CONFIG_NAME, lambda d: linearize.save_pretrained(model, d)),
                       (FOLDED_CONFIG, lambda d: linearize.save_folded(linearize.fold(model, x), d, example_inputs=x)),
                       ("report.json", lambda d: linearize.report(model, x, progress=False,
                                                                  skip=["affinity", "regions"]).save(d))]:
        (tmp_path / name / name).mkdir(parents=True)
        with pytest.raises(IsADirectoryError, match=rf"{name} is a folder, where a save writes a file: move or remove"):
            save(tmp_path / name)
        assert not [p for p in (tmp_path / name).iterdir() if p.name.endswith(".tmp")]  # nothing left half-written
    with pytest.raises(linearize.LoadError, match=rf"{CONFIG_NAME} is a folder, where a sidecar config should be"):
        linearize.from_pretrained(_fresh(), tmp_path / CONFIG_NAME, example_inputs=x)
    with pytest.raises(linearize.LoadError, match=rf"{FOLDED_CONFIG} is a folder, where a {FOLDED_CONFIG} should be"):
        linearize.load_folded(tmp_path / FOLDED_CONFIG)
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / CONFIG_NAME)
    with pytest.raises(linearize.LoadError, match=rf"{CONFIG_NAME} is not a regular file \(a FIFO"):
        linearize.from_pretrained(_fresh(), tmp_path / "fifo", example_inputs=x)
    (tmp_path / "dangling").symlink_to(tmp_path / "moved-away")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(FileNotFoundError, match="dangling is a symbolic link to .*moved-away, which does not exist: "
                                                "create the folder it links to, or remove the link"):
        linearize.save_pretrained(model, tmp_path / "dangling")
    with pytest.raises(OSError, match="loop is a loop of symbolic links .*: remove the link"):
        linearize.save_pretrained(model, tmp_path / "loop")


def test_a_saves_file_given_for_its_folder_or_a_fifo_config_json_is_named_with_the_fix(tmp_path):
    """The save's own file given instead of its folder (linearize_config.json, folded.json), and a FIFO where a
    converted HF save's config.json should be: the error names that file and the fix (pass its folder; a FIFO
    refused by name, also by the CLI's loader), where it said the folder had no such file and to write one. The
    folder itself loads."""
    transformers = pytest.importorskip("transformers")
    model, x = _mlp(), torch.randn(8, 4)
    linearize.save_pretrained(model, tmp_path / "sidecar")
    linearize.save_folded(linearize.fold(model, x), tmp_path / "folded", example_inputs=x)
    with pytest.raises(NotADirectoryError, match=rf"{tmp_path}/sidecar/{CONFIG_NAME} is a file, not a folder: a "
                                                 rf"linearize save is loaded from its folder; pass the folder that "
                                                 rf"holds it \({tmp_path}/sidecar\)"):
        linearize.from_pretrained(_fresh(), tmp_path / "sidecar" / CONFIG_NAME, example_inputs=x)
    with pytest.raises(NotADirectoryError, match=rf"{tmp_path}/folded/{FOLDED_CONFIG} is a file, not a folder: a "
                                                 rf"folded save .*\({tmp_path}/folded\)"):
        linearize.load_folded(tmp_path / "folded" / FOLDED_CONFIG)
    loaded = linearize.from_pretrained(_fresh(), tmp_path / "sidecar", example_inputs=x)
    assert all(torch.equal(u.slope, torch.full_like(u.slope, 0.5)) for _, u in linearize.units(loaded))
    with torch.no_grad():
        torch.testing.assert_close(linearize.load_folded(tmp_path / "folded")(x), model(x), rtol=1e-5, atol=1e-5)

    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64)
    hf_dir = tmp_path / "hf"
    linearize.convert(transformers.BertModel(config)).save_pretrained(hf_dir)
    os.replace(hf_dir / "config.json", tmp_path / "config.json")
    os.mkfifo(hf_dir / "config.json")
    with pytest.raises(linearize.LoadError, match=rf"{hf_dir}/config.json is not a regular file \(a FIFO, device or "
                                                  "socket\), where a Hugging Face config should be"):
        linearize.from_pretrained(transformers.BertModel, hf_dir)
    from linearize.models import load_model  # the CLI's loader (linearize inspect DIR): refused, not waited on

    with pytest.raises(linearize.LoadError, match=rf"{hf_dir}/config.json is not a regular file \(a FIFO"):
        load_model(str(hf_dir))
