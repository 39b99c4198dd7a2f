"""Sidecar save/load: bit-identical round trips, clear errors on mismatch."""

import json

import pytest
import torch
import torchvision
import transformers as hf

import linearize
from linearize.serialization import CONFIG_NAME, WEIGHTS_NAME


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
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME])
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
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
