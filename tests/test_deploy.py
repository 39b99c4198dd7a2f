"""Folded models: save_folded / load_folded without pickle (HF, torchvision, timm, plain), refusals,
torch.export and ONNX (ONNX Runtime within 1e-4 of torch)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

import linearize
from linearize import LoadError
from linearize.deploy import folded_weights_name
from zoo import random_slopes, save_folded_functional, tiny_bert
import copy
import threading
import torch.nn.functional as F
from linearize import deploy
from pathlib import Path


def _half_linear(model: nn.Module, x) -> nn.Module:
    """Converted, half of the channels linear (slope 1), the rest mixed: fold has work of each kind."""
    torch.manual_seed(0)
    linearize.convert(model.eval(), example_inputs=x)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.copy_(torch.where(torch.rand_like(u.slope) < 0.5, 1.0, torch.rand_like(u.slope) * 0.5))
    return linearize.fold(model, x, latency=False).eval()


def _bert():
    pytest.importorskip("transformers")
    x = {"input_ids": torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(1))}
    return _half_linear(tiny_bert(), x), x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def _call(model: nn.Module, x):
    with torch.no_grad():
        out = model(**x) if isinstance(x, dict) else model(x)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out


def test_folded_bert_round_trip(tmp_path):
    folded, x = _bert()
    assert type(folded.encoder.layer[0].intermediate.dense).__name__ == "LinearWithPassthrough"
    ref = _call(folded, x)
    linearize.save_folded(folded, tmp_path)
    assert not list(tmp_path.glob("*.pt")) and not list(tmp_path.glob("*.bin"))
    assert torch.equal(_call(linearize.load_folded(tmp_path), x), ref)


def test_folded_torchvision_and_timm_round_trip(tmp_path):
    tv = pytest.importorskip("torchvision")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    folded = _half_linear(tv.models.resnet18(num_classes=10), x)
    linearize.save_folded(folded, tmp_path / "tv", builder="torchvision:resnet18", builder_kwargs={"num_classes": 10})
    assert torch.equal(_call(linearize.load_folded(tmp_path / "tv"), x), _call(folded, x))
    timm = pytest.importorskip("timm")
    folded = _half_linear(timm.create_model("resnet10t", num_classes=5), x)
    linearize.save_folded(folded, tmp_path / "timm")  # timm models name their builder themselves
    assert torch.equal(_call(linearize.load_folded(tmp_path / "timm"), x), _call(folded, x))


def test_a_folded_torchvision_segmentation_model_loads_offline_without_fetching_its_backbone(tmp_path, monkeypatch):
    """lraspp's builder (as deeplabv3, fcn, fasterrcnn, ...) fetched ImageNet weights for its backbone by default:
    load_folded of its folded save downloaded them (offline: a URLError), though a load never fetches. With every
    download made to fail, it loads, and computes as the model saved."""
    tv = pytest.importorskip("torchvision")
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    model = tv.models.get_model("lraspp_mobilenet_v3_large", weights=None, weights_backbone=None, num_classes=3)
    folded = _half_linear(model, x)
    linearize.save_folded(folded, tmp_path / "seg", builder="torchvision:lraspp_mobilenet_v3_large",
                          builder_kwargs={"num_classes": 3})

    def offline(url, *args, **kwargs):
        raise OSError(f"offline: fetched {url}")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # nothing cached there
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    monkeypatch.setattr("urllib.request.urlopen", offline)
    loaded = linearize.load_folded(tmp_path / "seg")
    assert torch.equal(_call(loaded, x)["out"], _call(folded, x)["out"])
    assert not (tmp_path / "torch").exists()


def test_plain_models(tmp_path):
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    seq = _half_linear(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)), x)
    linearize.save_folded(seq, tmp_path / "seq", example_inputs=x)  # an 8x8 input: no guess fits its Linear
    assert torch.equal(_call(linearize.load_folded(tmp_path / "seq"), x), _call(seq, x))  # torch.nn only: no base
    net = _half_linear(Net(), x)
    linearize.save_folded(net, tmp_path / "net")
    with pytest.raises(LoadError, match=r"test_deploy\.Net.*base=YourModel"):
        linearize.load_folded(tmp_path / "net")
    assert torch.equal(_call(linearize.load_folded(tmp_path / "net", base=Net()), x), _call(net, x))


def test_the_base_given_to_load_folded_is_left_as_it_is(tmp_path):
    """The original model given as ``base`` (kept to compare the deployed model with) was rebuilt in place: its
    outputs became the folded model's."""
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    original = Net().eval()
    with torch.no_grad():
        want = _call(original, x)
    net = _half_linear(copy.deepcopy(original), x)
    linearize.save_folded(net, tmp_path / "net")
    loaded = linearize.load_folded(tmp_path / "net", base=original)
    assert loaded is not original and torch.equal(_call(original, x), want)
    assert torch.equal(_call(loaded, x), _call(net, x)) and not torch.equal(_call(loaded, x), want)
    locked = Net().eval()
    locked.lock = threading.Lock()  # cannot be copied: rebuilt in itself, as before, and said so
    with pytest.warns(UserWarning, match=r"base \(Net\) cannot be copied.*rebuilt in it.*freshly built"):
        loaded = linearize.load_folded(tmp_path / "net", base=locked, check=False)  # the check copies too
    assert loaded is locked and torch.equal(_call(loaded, x), _call(net, x))


class _Wrapper(nn.Module):
    """A model whose own child is named ``module`` (a normalising wrapper, timm's ModelEmaV3 layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_a_submodule_named_module_keeps_its_name_and_wrappers_are_unwrapped(tmp_path):
    """The saved keys of a child named ``module`` lost that prefix (every load refused the save as damaged); the
    DataParallel and torch.compile wrappers around a model still save the model inside, file for file."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    folded = _half_linear(_Wrapper(), x)
    truth = _call(folded, x)
    files = []
    for name, model in (("plain", folded), ("data parallel", nn.DataParallel(folded)),
                        ("compiled", torch.compile(folded))):
        linearize.save_folded(model, tmp_path / name, example_inputs=x)
        files.append(json.loads((tmp_path / name / "folded.json").read_text())["weights"]["file"])
        torch.manual_seed(1)  # a fresh base with other weights
        loaded = linearize.load_folded(tmp_path / name, base=_Wrapper())
        assert torch.equal(_call(loaded, x), truth), name
    assert len(set(files)) == 1


class _Calibrated(nn.Module):
    """A layer whose calibrated ``scale`` is non-tensor extra state (get_extra_state)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.scale = nn.Linear(4, 8), 1.0

    def get_extra_state(self) -> dict:
        return {"scale": self.scale}

    def set_extra_state(self, state: dict) -> None:
        self.scale = state["scale"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_extra_state_of_a_folded_module_loads_back_as_torch_state_dict_does(tmp_path):
    """save_folded crashed on a module's non-tensor extra state (AttributeError 'dict' object has no attribute
    'data_ptr'). Truth: torch's own state_dict round trip of the folded model."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = nn.Sequential(_Calibrated(), nn.ReLU(), nn.Linear(8, 3))
    model[0].scale = 2.5
    folded = _half_linear(model, x)
    torch_copy = copy.deepcopy(folded)
    torch_copy[0].scale = 1.0
    torch_copy.load_state_dict(folded.state_dict())
    linearize.save_folded(folded, tmp_path, builder="plain", example_inputs=x)
    loaded = linearize.load_folded(tmp_path, base=nn.Sequential(_Calibrated(), nn.ReLU(), nn.Linear(8, 3)))
    assert loaded[0].scale == torch_copy[0].scale == 2.5
    assert torch.equal(_call(loaded, x), _call(torch_copy, x))
    meta = json.loads((tmp_path / "folded.json").read_text())
    del meta["extra_state"]  # a save without it
    (tmp_path / "folded.json").write_text(json.dumps(meta))
    with pytest.raises(LoadError, match=r"(?s)does not fit the rebuilt model .*0\._extra_state"):
        linearize.load_folded(tmp_path, base=nn.Sequential(_Calibrated(), nn.ReLU(), nn.Linear(8, 3)))


def test_unknown_classes_and_damage_are_refused(tmp_path):
    x = torch.randn(2, 3, 8, 8)
    seq = _half_linear(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)), x)
    linearize.save_folded(seq, tmp_path, example_inputs=x)
    meta_path = tmp_path / "folded.json"
    meta = json.loads(meta_path.read_text())
    meta["modules"][1]["class"] = "os.system"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(LoadError, match=r"folded\.json.*os\.system"):
        linearize.load_folded(tmp_path)
    linearize.save_folded(seq, tmp_path, example_inputs=x)
    weights = tmp_path / json.loads(meta_path.read_text())["weights"]["file"]
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1
    weights.write_bytes(bytes(raw))
    with pytest.raises(LoadError, match=r"folded-[0-9a-f]{16}\.safetensors.*SHA-256"):
        linearize.load_folded(tmp_path)


@pytest.mark.parametrize("edit, match", [
    (lambda j: j.__setitem__("base", True), r"base must be an object"),
    (lambda j: j["modules"][0].__setitem__("class", None), r"modules\[0\]\.class must be a string"),
    (lambda j: j["modules"][0].pop("class"), r"modules\[0\]\.class must be a string"),
    (lambda j: j["modules"].__setitem__(1, None), r"modules\[1\] is a NoneType"),
    (lambda j: j["modules"][1].pop("name"), r"modules\[1\]\.name must be a string"),
    (lambda j: j["modules"][3].__setitem__("name", "x.y"), r"modules\[3\]\.name 'x\.y' is a module named twice, or "
                                                            r"before its parent"),
    (lambda j: j["modules"][0].__setitem__("args", ""), r"modules\[0\]\.args must be an object"),
    (lambda j: j["modules"][1].pop("children"), r"modules\[1\]\.children must be a list"),
    (lambda j: j["modules"][1].__setitem__("children", [{"a": [None]}]), r"modules\[1\]\.children must be a list "
                                                                           r"of names"),
    (lambda j: j["modules"][1].__setitem__("args", {"in_channels": {"a": [1]}}), r"module '0' .*bad arguments"),
    (lambda j: j.__setitem__("probe", "yes"), r"probe must be an object"),
    (lambda j: j.__setitem__("extra_state", []), r"not a folded-model description"),
    (lambda j: j.__setitem__("base", {"kind": "torchvision", "name": "resnet18", "kwargs": [1]}),
     r"base of kind torchvision must hold a builder name and kwargs"),
    (lambda j: j.__setitem__("base", {"kind": "torchvision", "name": "resnet18", "kwargs": {"weights": "x"}}),
     r"base\.kwargs holds \['weights'\], which would make torchvision fetch or read weights"),
    (lambda j: j.__setitem__("base", {"kind": "torchvision", "name": "nosuchnet"}),
     r"base torchvision model 'nosuchnet' cannot be built"),
    (lambda j: j.__setitem__("base", {"kind": "timm", "name": "resnet18", "kwargs": {"pretrained": True}}),
     r"base\.kwargs holds \['pretrained'\]"),
    (lambda j: j.__setitem__("base", {"kind": "transformers", "class": "BertModel", "config": []}),
     r"base of kind transformers must hold a class name and a config"),
])
def test_an_edited_folded_json_is_a_load_error_naming_the_file_and_field(tmp_path, edit, match):
    """Each edit (the weights' checksum intact) raised a bare AttributeError, TypeError, KeyError or ValueError
    that named no file."""
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    seq = _half_linear(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                                     nn.Linear(4 * 6 * 6, 5)), x)
    linearize.save_folded(seq, tmp_path, example_inputs=x)
    meta = json.loads((tmp_path / "folded.json").read_text())
    edit(meta)
    (tmp_path / "folded.json").write_text(json.dumps(meta))
    with pytest.raises(LoadError, match=r"folded\.json: " + match):
        linearize.load_folded(tmp_path)


@pytest.mark.parametrize("kind, key, value", [
    ("timm", "checkpoint_path", "{file}"), ("timm", "pretrained_cfg", {"file": "{file}"}),
    ("timm", "pretrained_cfg_overlay", {"file": "{file}"}), ("timm", "cache_dir", "{dir}"),
    ("torchvision", "weights_backbone", "DEFAULT"), ("torchvision", "progress", True),
])
def test_base_kwargs_that_read_files_or_weights_are_refused_before_anything_is_opened(tmp_path, monkeypatch, kind,
                                                                                      key, value):
    """A crafted folded.json whose base kwargs make timm / torchvision read a file of the machine (checkpoint_path:
    torch.load of any path, twice) or fetch weights: it reached the builder, which opened the file and failed with
    its own error (IndexError, an empty FileNotFoundError). Now it is a LoadError naming folded.json and the field,
    and no file is read (torch.load is never called); save_folded refuses such builder_kwargs."""
    if kind == "timm":
        pytest.importorskip("timm")
    secret = tmp_path / "elsewhere.pth"
    torch.save({"w": torch.zeros(1)}, secret)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    seq = _half_linear(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)), x)
    save = tmp_path / "save"
    linearize.save_folded(seq, save, example_inputs=x)
    meta = json.loads((save / "folded.json").read_text())
    filled = json.loads(json.dumps(value).replace("{file}", str(secret)).replace("{dir}", str(tmp_path)))
    meta["base"] = {"kind": kind, "name": "resnet18", "kwargs": {"num_classes": 5, key: filled}}
    (save / "folded.json").write_text(json.dumps(meta))
    loads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or pytest.fail("torch.load was called"))
    with pytest.raises(LoadError, match=rf"folded\.json: base\.kwargs holds \['{key}'\], which would make {kind} "
                                        r"fetch or read weights"):
        linearize.load_folded(save)
    assert loads == []
    with pytest.raises(ValueError, match=rf"builder_kwargs \['{key}'\] would make load_folded fetch or read"):
        linearize.save_folded(seq, tmp_path / "other", builder=f"{kind}:resnet18", builder_kwargs={key: filled})


_TIMM_WRAPPER = {"model_type": "timm_wrapper", "num_classes": 3}


@pytest.mark.parametrize("base, field", [
    ({"kind": "timm", "name": "local-dir:{dir}", "kwargs": {}}, "base.name"),
    ({"kind": "timm", "name": "hf-hub:timm/resnet18.a1_in1k", "kwargs": {}}, "base.name"),
    ({"kind": "timm", "name": "hf_hub:timm/resnet18.a1_in1k", "kwargs": {}}, "base.name"),
    ({"kind": "torchvision", "name": "{dir}", "kwargs": {}}, "base.name"),
    ({"kind": "transformers", "class": "TimmWrapperModel", "config": {**_TIMM_WRAPPER, "architecture": "local-dir:{dir}"}},
     "base.config.architecture"),
    ({"kind": "transformers", "class": "TimmWrapperModel",
      "config": {**_TIMM_WRAPPER, "architecture": "hf-hub:timm/resnet18.a1_in1k"}}, "base.config.architecture"),
    ({"kind": "transformers", "class": "TimmWrapperModel",
      "config": {**_TIMM_WRAPPER, "architecture": "resnet18", "model_args": {"pretrained_cfg_overlay":
                                                                           {"file": "{dir}/config.json"}}}},
     "base.config.model_args"),
    ({"kind": "transformers", "class": "DetrModel",
      "config": {"backbone_config": {"model_type": "timm_backbone", "backbone": "local-dir:{dir}"}}},
     "base.config.backbone_config.backbone"),
    ({"kind": "transformers", "class": "RfDetrModel", "config": {"backbone": "{dir}"}},
     "base.config.backbone"),
])
def test_base_names_that_fetch_or_read_files_are_refused_before_anything_is_opened(tmp_path, monkeypatch, base,
                                                                                    field):
    """A crafted folded.json whose base name (or a transformers config's timm architecture, backbone or
    model_args) is a timm source, 'local-dir:PATH' or 'hf-hub:ORG/NAME', or a path: timm read that folder's
    config.json (any folder of the machine) or looked the name up on the Hugging Face Hub (offline:
    LocalEntryNotFoundError, naming neither folded.json nor the fix). Now it is a LoadError naming folded.json and
    the field: no file outside the save is opened, nothing connects; save_folded refuses such a builder name."""
    import builtins
    import io
    import os
    import socket

    pytest.importorskip("timm")
    if base["kind"] == "transformers":
        pytest.importorskip("transformers")
    elsewhere = tmp_path / "elsewhere"  # a timm model folder outside the save
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text(json.dumps({"architecture": "resnet18", "num_classes": 5}))
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    seq = _half_linear(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)), x)
    save = tmp_path / "save"
    linearize.save_folded(seq, save, example_inputs=x)
    meta = json.loads((save / "folded.json").read_text())
    meta["base"] = json.loads(json.dumps(base).replace("{dir}", str(elsewhere)))
    (save / "folded.json").write_text(json.dumps(meta))
    seen: list[str] = []

    def recorded(real):
        def call(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)):
                seen.append(os.fspath(file))
            return real(file, *args, **kwargs)
        return call

    for module, name in ((builtins, "open"), (io, "open"), (os, "open"), (os, "stat"), (os, "listdir")):
        monkeypatch.setattr(module, name, recorded(getattr(module, name)))
    monkeypatch.setattr(socket.socket, "connect", lambda *a: pytest.fail(f"a connection to {a[1:]}"))
    with pytest.raises(LoadError, match=rf"folded\.json: {re.escape(field)} .*fetch or read"):
        linearize.load_folded(save)
    assert [p for p in seen if str(elsewhere) in p] == []
    if base["kind"] != "transformers":
        builder = f"{base['kind']}:{meta['base']['name']}"
        with pytest.raises(ValueError, match=rf"builder '{re.escape(builder)}': NAME must be a plain"):
            linearize.save_folded(seq, tmp_path / "other", builder=builder)


@pytest.mark.parametrize("kind", ["torchvision", "transformers"])
def test_crafted_base_arguments_are_refused_before_the_base_is_allocated(tmp_path, monkeypatch, kind):
    """An edited number in folded.json's base record (torchvision's num_classes, a transformers config's
    vocab_size) had load_folded build the whole base at that size before any check, though the weights file
    holds nothing of it. Now the base is sized on the meta device first and refused, naming the file and the
    field; the unedited save loads with the folded model's outputs."""
    if kind == "torchvision":
        tv = pytest.importorskip("torchvision")
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        folded = _half_linear(tv.models.resnet18(num_classes=10), x)
        linearize.save_folded(folded, tmp_path, builder="torchvision:resnet18", builder_kwargs={"num_classes": 10})
        field, key, value, layer = "kwargs", "num_classes", 10**6, nn.Linear  # a 2 GB head
    else:
        folded, x = _bert()
        linearize.save_folded(folded, tmp_path)
        field, key, value, layer = "config", "vocab_size", 10**7, nn.Embedding  # 640 MB of embeddings
    assert torch.equal(_call(linearize.load_folded(tmp_path), x), _call(folded, x))
    meta = json.loads((tmp_path / "folded.json").read_text())
    meta["base"][field][key] = value
    (tmp_path / "folded.json").write_text(json.dumps(meta))
    built = []
    monkeypatch.setattr(layer, "reset_parameters", lambda self: built.append(self.weight.device.type))
    with pytest.raises(LoadError, match=rf"folded\.json: base\.{field} \(largest numbers: {key} {value}\b.*over 16 "
                                        r"times the .* MiB of its weights file"):
        linearize.load_folded(tmp_path)
    assert built and "cpu" not in built  # sized on the meta device only


@pytest.mark.parametrize("field, value", [("in_features", 10**12), ("out_features", 5)])
def test_crafted_layer_arguments_are_refused_before_anything_is_allocated(tmp_path, monkeypatch, field, value):
    x = torch.randn(2, 3, 8, 8)
    seq = _half_linear(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)), x)
    linearize.save_folded(seq, tmp_path, example_inputs=x)
    meta_path = tmp_path / "folded.json"
    meta = json.loads(meta_path.read_text())
    entry = next(e for e in meta["modules"] if e["class"].endswith("Linear"))
    entry["args"][field] = value  # 4 TB of weights at 10**12, or a shape the file does not hold
    meta_path.write_text(json.dumps(meta))
    built = []
    monkeypatch.setattr(nn.Linear, "reset_parameters", lambda self: built.append(self.weight.device.type))
    with pytest.raises(LoadError, match=rf"folded\.json: module '{entry['name']}' \(Linear\): its arguments make "
                                        r"'weight' of shape .* the weights file has shape \[3, 144\]"):
        linearize.load_folded(tmp_path)
    assert "cpu" not in built  # sized on the meta device only


def test_folded_models_export(tmp_path):
    folded, x = _bert()
    ids = x["input_ids"]
    ref = _call(folded, x)
    exported = torch.export.export(folded, (), {"input_ids": ids})
    assert torch.equal(exported.module()(input_ids=ids).last_hidden_state, ref)
    ort = pytest.importorskip("onnxruntime", reason="ONNX test: pip install onnx onnxruntime onnxscript (dev extra)")
    pytest.importorskip("onnx")

    class Hidden(nn.Module):  # a tensor output for the ONNX graph
        def __init__(self, m: nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=input_ids).last_hidden_state

    path = tmp_path / "folded.onnx"
    torch.onnx.export(Hidden(folded).eval(), (ids,), str(path), input_names=["input_ids"], dynamo=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"input_ids": ids.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), ref, rtol=0, atol=1e-4)


def test_folded_functional_sites_round_trip(tmp_path):
    """``F.relu``/``F.gelu`` calls in a forward (functional sites) save and load: the truth is the
    converted model itself on fresh inputs (another batch size, other values)."""
    from zoo import FunctionalNet

    model, _ = save_folded_functional(tmp_path)
    loaded = linearize.load_folded(tmp_path, base=FunctionalNet())
    x = torch.randn(7, 3, 8, 8) * 3
    with torch.no_grad():
        ref, out = model(x), loaded(x)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert not linearize.units(loaded)
    assert torch.equal(loaded(x), out)  # a second call dispatches the same way


@pytest.mark.parametrize("edit, match", [
    (lambda e: e["args"].update(slots=["relu_0"]), "one length"),
    (lambda e: e["args"].update(kinds=["os.system"] * len(e["args"]["kinds"])), "activation kinds"),
    (lambda e: e["args"]["slots"].__setitem__(0, "fc1"), "slot 0"),
])
def test_crafted_functional_sites_are_refused(tmp_path, edit, match):
    from zoo import FunctionalNet

    save_folded_functional(tmp_path)
    meta = json.loads((tmp_path / "folded.json").read_text())
    entry = next(e for e in meta["modules"] if e["class"].endswith("FunctionalSites"))
    edit(entry)
    (tmp_path / "folded.json").write_text(json.dumps(meta))
    with pytest.raises(LoadError, match=match):
        linearize.load_folded(tmp_path, base=FunctionalNet())


@pytest.mark.parametrize("name", ["mobilenetv3_small_050", "convnext_atto"])
def test_timm_modules_fold_moved_and_timm_activations_load_back(name, tmp_path):
    """A fold that merges a timm block into a Sequential moves its SqueezeExcite (a class load_folded takes
    from the base) to a new path; a blend keeps timm's GELU at a path the base does not have."""
    timm = pytest.importorskip("timm")
    x = torch.randn(2, 3, 32, 32)
    folded = _half_linear(timm.create_model(name, pretrained=False, num_classes=10), x)
    linearize.save_folded(folded, tmp_path)
    back = linearize.load_folded(tmp_path)
    with torch.no_grad():
        assert torch.equal(back(x), folded(x))
    if name.startswith("mobilenet"):  # the premise: a module fold moved, found at its old path in the base
        moved = [e for e in json.loads((tmp_path / "folded.json").read_text())["modules"] if "origin" in e]
        assert moved and all(e["class"].endswith("SqueezeExcite") for e in moved)


def test_a_loaded_fold_saves_again_and_an_origin_used_twice_is_refused(tmp_path):
    timm = pytest.importorskip("timm")
    x = torch.randn(2, 3, 32, 32)
    folded = _half_linear(timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=10), x)
    linearize.save_folded(folded, tmp_path / "a")
    back = linearize.load_folded(tmp_path / "a")
    linearize.save_folded(back, tmp_path / "b")  # the moved modules keep their origin through a load
    with torch.no_grad():
        assert torch.equal(linearize.load_folded(tmp_path / "b")(x), folded(x))
    meta = json.loads((tmp_path / "a" / "folded.json").read_text())
    moved = [e for e in meta["modules"] if "origin" in e]
    moved[1]["origin"] = moved[0]["origin"]  # hostile: one base module at two paths
    (tmp_path / "a" / "folded.json").write_text(json.dumps(meta))
    with pytest.raises(LoadError, match="an 'origin' used twice"):
        linearize.load_folded(tmp_path / "a")
    moved[1]["origin"] = ""  # the base's root
    (tmp_path / "a" / "folded.json").write_text(json.dumps(meta))
    with pytest.raises(LoadError, match=rf"{moved[1]['name']}.*(used twice|in the save but)"):
        linearize.load_folded(tmp_path / "a")


class _Scaled(nn.Module):
    """A base whose output depends on a constructor argument no save records."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.fc, self.act, self.out, self.scale = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x))) * self.scale


def test_a_base_built_with_other_arguments_is_refused_by_the_saved_probe(tmp_path):
    """The rebuilt model runs on the probe saved with it (one input row and the outputs it gave): a base with
    another argument loads strictly (same names and shapes) but computes something else."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    folded = _half_linear(_Scaled(), x)
    linearize.save_folded(folded, tmp_path, example_inputs=x)
    assert json.loads((tmp_path / "folded.json").read_text())["probe"] == {"saved": True, "why_not": ""}
    with pytest.raises(LoadError, match=r"does not compute what the saved one did .*base=\.\.\..*check=False"):
        linearize.load_folded(tmp_path, base=_Scaled(2.0))
    unchecked = linearize.load_folded(tmp_path, base=_Scaled(2.0), check=False)
    torch.testing.assert_close(_call(unchecked, x), 2 * _call(folded, x))  # what the check kept out
    assert torch.equal(_call(linearize.load_folded(tmp_path, base=_Scaled()), x), _call(folded, x))


def test_timm_arguments_no_save_records_are_caught_and_base_loads_them(tmp_path):
    """save_folded records a timm model's num_classes only: a ViT's global_pool='avg' came back as 'token'
    (same names and shapes, another function) without a word."""
    timm = pytest.importorskip("timm")

    def vit() -> nn.Module:
        return timm.create_model("test_vit", num_classes=0, global_pool="avg", fc_norm=False)

    x = torch.randn(2, 3, 160, 160, generator=torch.Generator().manual_seed(0))
    folded = _half_linear(vit(), x)
    linearize.save_folded(folded, tmp_path)  # probe guessed (timm's input size)
    with pytest.raises(LoadError, match="does not compute what the saved one did"):
        linearize.load_folded(tmp_path)
    assert torch.equal(_call(linearize.load_folded(tmp_path, base=vit()), x), _call(folded, x))


def test_a_model_without_a_probe_is_refused_unless_told_probe_false(tmp_path):
    class NoLayers(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.relu()

    with pytest.raises(ValueError, match=r"no probe for load_folded to check the rebuilt NoLayers with \(no input to "
                                         r"guess.*pass example_inputs=.*or probe=False"):
        linearize.save_folded(NoLayers(), tmp_path)
    assert not tmp_path.joinpath("folded.json").exists()
    linearize.save_folded(NoLayers(), tmp_path, probe=False)
    assert json.loads((tmp_path / "folded.json").read_text())["probe"] == {"saved": False, "why_not": "probe=False"}
    with pytest.raises(ValueError, match="not both"):
        linearize.save_folded(NoLayers(), tmp_path, probe=False, example_inputs=torch.randn(2, 3))
    with pytest.raises(ValueError, match="fails on its example_inputs"):
        linearize.save_folded(nn.Linear(4, 2), tmp_path / "bad", example_inputs=torch.randn(3, 5))
    uncopyable = nn.Linear(4, 2)
    uncopyable.stream = (i for i in range(3))  # copy.deepcopy refuses a generator
    with pytest.raises(ValueError, match=r"the model cannot be copied .*; pass probe=False"):
        linearize.save_folded(uncopyable, tmp_path / "gen", example_inputs=torch.randn(3, 4))
    linearize.save_folded(uncopyable, tmp_path / "gen", probe=False)
    assert torch.equal(linearize.load_folded(tmp_path / "gen").weight, uncopyable.weight)


class _TwoInputs(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.a, self.b, self.act, self.out = nn.Linear(4, 8), nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)
        self.scale = scale

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.a(x) + self.b(y))) * self.scale


def test_a_two_input_model_needs_example_inputs_for_its_probe(tmp_path):
    """save_folded of a two-input model without example_inputs saved no probe and said nothing: a base built
    with another argument then loaded unchecked (0.449 off). It is refused, naming example_inputs; with
    them, the probe catches that base."""
    g = torch.Generator().manual_seed(0)
    x = {"x": torch.randn(5, 4, generator=g), "y": torch.randn(5, 3, generator=g)}
    folded = _half_linear(_TwoInputs(), x)
    truth = _call(folded, x)  # before saving
    with pytest.raises(ValueError, match=r"no probe .*_TwoInputs.*pass example_inputs="):
        linearize.save_folded(folded, tmp_path)
    linearize.save_folded(folded, tmp_path, example_inputs=x)
    with pytest.raises(LoadError, match="does not compute what the saved one did"):
        linearize.load_folded(tmp_path, base=_TwoInputs(2.0))
    assert torch.equal(_call(linearize.load_folded(tmp_path, base=_TwoInputs()), x), truth)


def test_a_torchvision_model_without_builder_is_refused_at_save(tmp_path):
    """save_folded accepted a torchvision model without builder= that load_folded then refused (its classes
    need a base): refused when saved, naming builder=; with it the model loads back."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = tv.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    truth = _call(model, x)
    with pytest.raises(ValueError, match=r"torchvision.models.resnet.ResNet is a torchvision model.*"
                                         r"builder='torchvision:NAME'.*builder_kwargs"):
        linearize.save_folded(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    linearize.save_folded(model, tmp_path / "out", builder="torchvision:resnet18", builder_kwargs={"num_classes": 10})
    assert torch.equal(_call(linearize.load_folded(tmp_path / "out"), x), truth)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_folds_load_in_their_dtype(tmp_path, dtype):
    """The rebuilt model was float32 with only its PReLUs cast: it failed on inputs of either dtype."""
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    model = linearize.convert(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval(),
                              example_inputs=x)
    with torch.no_grad():
        linearize.units(model)[0][1].slope.uniform_(0.1, 0.9)  # partly linear: a ChannelPReLU stays
    folded = linearize.fold(model.to(dtype), x.to(dtype), latency=False, rtol=5e-2)
    linearize.save_folded(folded, tmp_path)
    loaded = linearize.load_folded(tmp_path)
    assert {p.dtype for p in loaded.parameters()} == {dtype}
    assert torch.equal(_call(loaded, x.to(dtype)), _call(folded, x.to(dtype)))


def test_a_conv_subclass_given_a_bias_by_fold_loads_from_its_base(tmp_path):
    """fold merges a BatchNorm into a conv built with bias=False (torchvision's Conv3DSimple, timm's
    Conv2dSame): the class comes from the base, without the bias the save holds."""

    class MyConv(nn.Conv2d):
        pass

    def net() -> nn.Module:
        return nn.Sequential(MyConv(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))

    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    folded = _half_linear(net(), x)
    assert folded[0].bias is not None
    linearize.save_folded(folded, tmp_path)
    assert torch.equal(_call(linearize.load_folded(tmp_path, base=net()), x), _call(folded, x))


class _Counting(nn.Module):
    """Writes into its input and counts its calls in a buffer: the probe must change neither the caller's
    inputs nor the saved state (the file held the state after the probe, the outputs of the state before)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act = nn.Linear(4, 4), nn.ReLU()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.act(self.fc(x.mul_(2))) + self.calls


def test_the_probe_changes_neither_the_inputs_nor_the_model_and_loads_back(tmp_path):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    model, before = _Counting().eval(), x.clone()
    linearize.save_folded(model, tmp_path, example_inputs=x)
    assert torch.equal(x, before) and model.calls.item() == 0
    loaded = linearize.load_folded(tmp_path, base=_Counting())
    assert loaded.calls.item() == 0
    ref = 2 * before @ model.fc.weight.T + model.fc.bias  # its first call, by hand
    torch.testing.assert_close(loaded(before.clone()), ref.relu() + 1)


def test_inputs_batched_off_dim_0_are_probed_whole(tmp_path):
    """An RNN's (x [B, T, D], h0 [1, B, H]): one row of x with all of h0 fails; the whole input is saved."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.out = nn.GRU(4, 8, batch_first=True), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
            return self.out(self.rnn(x, h0)[0])

    torch.manual_seed(0)
    model, inputs = Net().eval(), (torch.randn(3, 5, 4), torch.randn(1, 3, 8))
    linearize.save_folded(model, tmp_path, example_inputs=inputs)
    loaded = linearize.load_folded(tmp_path, base=Net())
    torch.testing.assert_close(loaded(*inputs), model(*inputs))


def test_an_unsaved_buffer_of_a_half_precision_model_takes_its_dtype(tmp_path):
    """A non-persistent float buffer (timm BlurPool2d's filter) stayed float32 beside bf16 weights."""

    class Blur(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)
            self.register_buffer("filt", torch.full((3, 1, 3, 3), 1 / 9), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.conv2d(self.conv(x), self.filt, groups=3)

    model, x = Blur().to(torch.bfloat16).eval(), torch.randn(2, 3, 6, 6, dtype=torch.bfloat16)
    linearize.save_folded(model, tmp_path)
    loaded = linearize.load_folded(tmp_path, base=Blur())
    assert loaded.filt.dtype == torch.bfloat16 and torch.equal(loaded(x), model(x))


def _rewrite(directory, edit) -> None:
    """Edit the saved tensors and write them back with a matching checksum (a crafted, consistent save)."""
    import hashlib

    import safetensors.torch

    meta = json.loads((directory / "folded.json").read_text())
    tensors = safetensors.torch.load((directory / meta["weights"]["file"]).read_bytes())
    edit(tensors)
    data = safetensors.torch.save(tensors, {"format": "pt"})
    digest = hashlib.sha256(data).hexdigest()
    meta["weights"] = {"file": folded_weights_name(digest), "bytes": len(data), "sha256": digest}
    (directory / meta["weights"]["file"]).write_bytes(data)
    (directory / "folded.json").write_text(json.dumps(meta))


P = "__linearize_probe__."


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.__setitem__(P + "arg.x", t[P + "arg.0"].clone()), "malformed probe tensor"),
    (lambda t: t.__setitem__(P + "output.0", t[P + "output.0"].long()), "malformed probe tensor"),
    (lambda t: t.__setitem__(P + "arg.7", t[P + "arg.0"].clone()), r"probe args numbered \['0', '7'\]"),
    (lambda t: [t.pop(k) for k in [k for k in t if k.startswith(P)]], "holds no probe output"),
    (lambda t: t.__setitem__(P + "output.0", t[P + "output.0"] + 1), "does not compute what the saved one did"),
])
def test_a_crafted_probe_is_refused_naming_it(tmp_path, edit, match):
    x = torch.randn(2, 3, 8, 8)
    seq = _half_linear(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)), x)
    linearize.save_folded(seq, tmp_path, example_inputs=x)
    _rewrite(tmp_path, edit)
    with pytest.raises(LoadError, match=match):
        linearize.load_folded(tmp_path)


def test_torch_transformer_stacks_load_without_a_base(tmp_path):
    """nn.TransformerEncoder / Decoder (and their layers) need a layer module or d_model to be built, which
    no attribute holds: they are made from their recorded plain attributes, their submodules rebuilt as
    children. Truth: the converted model (a partly linear first layer, an excluded plain relu in the second)."""
    torch.manual_seed(0)
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 3, 16)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                norm=nn.LayerNorm(16)).eval()
    dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True, activation="gelu"),
                                2).eval()
    for i, (model, inputs, kw) in enumerate([(enc, (x,), {"src_key_padding_mask": pad}), (dec, (x, memory), {})]):
        linearize.convert(model, example_inputs=inputs, exclude_modules=["layers.1.activation"])
        with torch.no_grad():
            linearize.units(model)[0][1].slope.uniform_(0, 1)
        folded = linearize.fold(model, inputs, latency=False)
        linearize.save_folded(folded, tmp_path / str(i), example_inputs=inputs)
        loaded = linearize.load_folded(tmp_path / str(i))
        assert type(loaded) is type(model)
        with torch.no_grad():  # eval + no_grad: the encoder's fused path where the layer's activation is plain
            torch.testing.assert_close(loaded(*inputs, **kw), model(*inputs, **kw), rtol=0, atol=1e-5)


@pytest.mark.parametrize("attributes, match", [
    ({"forward": 1}, "'forward' is not one a save records"),
    ({"_modules": {}}, "'_modules' is not one a save records"),
    ({"activation": {"function": "os.system"}}, "unknown function"),
])
def test_crafted_attributes_are_refused(tmp_path, attributes, match):
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 1).eval()
    linearize.save_folded(enc, tmp_path)
    meta = json.loads((tmp_path / "folded.json").read_text())
    meta["modules"][0]["args"] = {"attributes": attributes}
    (tmp_path / "folded.json").write_text(json.dumps(meta))
    with pytest.raises(LoadError, match=match):
        linearize.load_folded(tmp_path)


def test_builder_plain_saves_a_changed_torchvision_model_for_a_base_given_at_load(tmp_path):
    import torchvision

    def build() -> nn.Module:
        model = torchvision.models.resnet18(num_classes=4)
        model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)  # a CIFAR stem: no builder name rebuilds it
        model.maxpool = nn.Identity()
        return model.eval()

    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    model = linearize.convert(build(), example_inputs=x)
    folded = linearize.fold(model, x, latency=False)
    with pytest.raises(ValueError, match=r"builder='plain' when your own code builds it"):
        linearize.save_folded(folded, tmp_path / "a", example_inputs=x)
    linearize.save_folded(folded, tmp_path / "b", builder="plain", example_inputs=x)
    loaded = linearize.load_folded(tmp_path / "b", base=build())
    with torch.no_grad():
        assert torch.allclose(loaded(x), model(x), atol=1e-5)


def test_a_residual_block_saved_under_its_old_private_name_loads(tmp_path):
    """fold's residual block was ``linearize.folding.modules._Residual``: files that name it so still load."""
    from linearize.folding.modules import Residual

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    seq = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Residual(nn.Conv2d(4, 4, 3, padding=1), None),
                        nn.Flatten(), nn.Linear(256, 3)).eval()
    linearize.save_folded(seq, tmp_path, example_inputs=x)
    config = tmp_path / "folded.json"
    text = config.read_text()
    assert "linearize.folding.modules.Residual" in text
    config.write_text(text.replace("linearize.folding.modules.Residual", "linearize.folding.modules._Residual"))
    assert torch.equal(_call(linearize.load_folded(tmp_path), x), _call(seq, x))


def _seq() -> nn.Module:
    torch.manual_seed(0)
    model = linearize.convert(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)), example_inputs=torch.randn(2, 4))
    random_slopes(model)
    return model.eval()


def test_save_folded_interrupted_before_its_json_keeps_the_previous_save(tmp_path, monkeypatch):
    x = torch.randn(5, 4)
    first = linearize.fold(_seq(), x)
    linearize.save_folded(first, tmp_path)
    second = copy.deepcopy(first)
    with torch.no_grad():
        second[0].weight.add_(1.0)
    writes = []
    real = deploy.atomic_write

    def failing(path, data):
        writes.append(path.name)
        if path.name == deploy.FOLDED_CONFIG:
            raise OSError(28, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(deploy, "atomic_write", failing)
    with pytest.raises(OSError):
        linearize.save_folded(second, tmp_path)
    monkeypatch.undo()
    assert writes[0].startswith("folded-")  # the weights went to a new file, the JSON failed after
    with torch.no_grad():
        torch.testing.assert_close(linearize.load_folded(tmp_path)(x), first(x), rtol=0, atol=0)
    linearize.save_folded(second, tmp_path)  # a later save succeeds and removes the orphaned weights
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) == 1
    with torch.no_grad():
        torch.testing.assert_close(linearize.load_folded(tmp_path)(x), second(x), rtol=0, atol=0)


def test_save_folded_killed_while_writing_leaves_files_that_loads_ignore_and_the_next_save_removes(tmp_path):
    """What a kill -9 inside save_folded leaves (docs/saving.md): a complete weights file no folded.json names and
    the partial temp file of one being written. The folder loads the earlier fold, output for output, and the next
    save leaves only its own pair (and the lock)."""
    x = torch.randn(5, 4)
    first = linearize.fold(_seq(), x)
    second, third = copy.deepcopy(first), copy.deepcopy(first)
    with torch.no_grad():
        second[0].weight.add_(1.0)
        third[0].weight.add_(2.0)
    linearize.save_folded(third, tmp_path / "other")  # the weights file of a save killed before its folded.json
    orphan = next(p for p in (tmp_path / "other").iterdir() if p.name.endswith(".safetensors"))
    linearize.save_folded(first, tmp_path / "fold")
    (tmp_path / "fold" / orphan.name).write_bytes(orphan.read_bytes())
    (tmp_path / "fold" / f".{orphan.name}.0123456789ab.tmp").write_bytes(orphan.read_bytes()[:100])
    with torch.no_grad():
        torch.testing.assert_close(linearize.load_folded(tmp_path / "fold")(x), first(x), rtol=0, atol=0)
    linearize.save_folded(second, tmp_path / "fold")
    named = json.loads((tmp_path / "fold" / deploy.FOLDED_CONFIG).read_text())["weights"]["file"]
    assert named != orphan.name
    assert sorted(p.name for p in (tmp_path / "fold").iterdir()) == sorted([".linearize.lock", deploy.FOLDED_CONFIG,
                                                                           named])
    with torch.no_grad():
        torch.testing.assert_close(linearize.load_folded(tmp_path / "fold")(x), second(x), rtol=0, atol=0)


def test_load_folded_reads_the_old_file_name_and_refuses_paths_out_of_the_folder(tmp_path):
    x = torch.randn(5, 4)
    folded = linearize.fold(_seq(), x)
    linearize.save_folded(folded, tmp_path)
    meta_path = tmp_path / deploy.FOLDED_CONFIG
    meta = json.loads(meta_path.read_text())
    (tmp_path / meta["weights"]["file"]).rename(tmp_path / "folded.safetensors")  # a save of the old layout
    meta["weights"]["file"] = "folded.safetensors"
    meta_path.write_text(json.dumps(meta))
    with torch.no_grad():
        torch.testing.assert_close(linearize.load_folded(tmp_path)(x), folded(x), rtol=0, atol=0)
    for bad in ("../folded.safetensors", "/etc/passwd", 3, None):
        meta["weights"]["file"] = bad
        meta_path.write_text(json.dumps(meta))
        with pytest.raises(linearize.LoadError, match="names no weights file"):
            linearize.load_folded(tmp_path)


def test_two_savers_into_one_folder_leave_the_last_complete_save_loadable(tmp_path, monkeypatch):
    x = torch.randn(5, 4)
    a = linearize.fold(_seq(), x)
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[0].weight.add_(1.0)
    real = deploy.atomic_write

    def interleaved(path, data):  # B has written its weights when A saves completely, then B finishes
        real(path, data)
        if path.name.startswith("folded-") and not interleaved.done:
            interleaved.done = True
            monkeypatch.setattr(deploy, "atomic_write", real)
            linearize.save_folded(a, tmp_path)

    interleaved.done = False
    monkeypatch.setattr(deploy, "atomic_write", interleaved)
    linearize.save_folded(b, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(linearize.load_folded(tmp_path)(x), b(x), rtol=0, atol=0)


def test_load_folded_checks_the_size_before_reading(tmp_path, monkeypatch):
    x = torch.randn(5, 4)
    linearize.save_folded(linearize.fold(_seq(), x), tmp_path)
    meta = json.loads((tmp_path / deploy.FOLDED_CONFIG).read_text())
    weights = tmp_path / meta["weights"]["file"]
    with open(weights, "ab") as f:
        f.truncate(weights.stat().st_size + (1 << 30))  # 1 GiB more, sparse
    monkeypatch.setattr(type(weights), "read_bytes", lambda self: pytest.fail("read a file of the wrong size"))
    with pytest.raises(linearize.LoadError, match="truncated or modified"):
        linearize.load_folded(tmp_path)


def test_folded_float64_prelu_and_a_function_attribute_load_back(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.f = nn.Linear(4, 6), nn.Linear(6, 2), F.relu

        def forward(self, x):
            return self.b(self.f(self.a(x)))

    torch.manual_seed(0)
    x = torch.randn(8, 4, dtype=torch.float64)
    model = linearize.convert(Net().double(), example_inputs=x)
    random_slopes(model)
    folded = linearize.fold(model, x)
    linearize.save_folded(folded, tmp_path)
    loaded = linearize.load_folded(tmp_path, base=Net().double())
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-10, atol=1e-10)


def _edit_sites(tmp_path: Path, **args) -> None:
    meta = json.loads((tmp_path / "folded.json").read_text())
    entry = next(e for e in meta["modules"] if e["class"].endswith("FunctionalSites"))
    entry["args"].update(args)
    (tmp_path / "folded.json").write_text(json.dumps(meta))


def test_crafted_functional_channels_raise_load_error(tmp_path):
    """Truth (load_folded's contract: a damaged or crafted folded.json is a LoadError naming the file):
    ``channels: [[1], ...]`` is refused with LoadError. Observed: IndexError 'list index out of range'."""
    from zoo import FunctionalNet

    save_folded_functional(tmp_path)
    _edit_sites(tmp_path, channels=[[1]] * 3)
    with pytest.raises(LoadError):
        linearize.load_folded(tmp_path, base=FunctionalNet())


def test_functional_slots_must_name_their_children(tmp_path):
    """Truth: a record whose slots are all null while its children (relu_0, gelu_1, relu_2, with weights)
    are present does not describe the saved model: refused, or the loaded model computes the saved one.
    Observed: it loads, the children are never called, the output differs by ~0.14 from the model."""
    from zoo import FunctionalNet

    model, x = save_folded_functional(tmp_path)
    _edit_sites(tmp_path, slots=[None, None, None])
    try:
        loaded = linearize.load_folded(tmp_path, base=FunctionalNet())
    except LoadError:
        return
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("labels", [["cat", "dog"], ["architecture", "nature"], ["backbone", "head"]])
def test_a_folded_transformers_model_whose_labels_name_builder_fields_loads_back(tmp_path, labels):
    """The checks of a transformers base's builder fields (a timm ``architecture``, a ``backbone``) read the
    config and its sub-configs only: class labels that happen to be those words (``id2label`` / ``label2id``) are
    data, and such a save loads back. Truth: the folded model's own logits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1], num_labels=2,
                                    id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})
    x = torch.randn(1, 3, 32, 32)
    folded = linearize.fold(linearize.convert(transformers.ResNetForImageClassification(cfg).eval(), example_inputs=x),
                            x, latency=False)
    linearize.save_folded(folded, tmp_path / "save", example_inputs=x)
    back = linearize.load_folded(tmp_path / "save")
    torch.testing.assert_close(back(x).logits, folded(x).logits, rtol=0, atol=0)
