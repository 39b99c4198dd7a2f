"""One config per method: BlendConfig ("prelu") and GatedConfig ("dgn"/"dlgn") behind the
LinearizeConfig(mode=...) shortcut; JSON round trips (old single-config dicts included), clear errors
for another method's options, and the config's type choosing what convert does."""

import copy
import dataclasses
import json
import pickle

import pytest
import torch
from torch import nn

import linearize
from linearize.config import BlendConfig, GatedConfig, LinearizeConfig
from linearize.gated import GatedNetwork
from linearize.serialization import CONFIG_NAME

X = torch.randn(3, 4)
SHARED = {"activations", "target_modules", "exclude_modules", "channel_dim", "gates"}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def old_dict(**fields) -> dict:
    """A config dict as the single LinearizeConfig wrote it: every field of every mode, and ``extra``."""
    d = {"mode": "prelu", "activations": ["relu", "gelu"], "target_modules": None, "exclude_modules": None,
         "init_slope": 0.0, "channel_dim": None, "beta": None, "value_input": "x", "init": "independent",
         "hard_gates": False, "freeze_feature": False, "gates": "exclude", "extra": {}}
    return {**d, **fields}


def test_the_mode_picks_the_config_class_and_each_class_has_only_its_options():
    assert type(LinearizeConfig()) is BlendConfig and type(LinearizeConfig(mode="prelu")) is BlendConfig
    assert type(LinearizeConfig(mode="dgn")) is GatedConfig and type(LinearizeConfig(mode="dlgn")) is GatedConfig
    assert isinstance(BlendConfig(), LinearizeConfig) and isinstance(GatedConfig(), LinearizeConfig)
    blend = {f.name for f in dataclasses.fields(BlendConfig)}
    gated = {f.name for f in dataclasses.fields(GatedConfig)}
    assert blend == SHARED | {"mode", "init_slope", "granularity"}
    assert gated == SHARED | {"mode", "beta", "value_input", "init", "hard_gates", "freeze_feature"}
    assert GatedConfig().mode == "dgn" and GatedConfig().beta == 4.0 and GatedConfig(mode="dlgn").beta == 10.0
    assert "extra" not in LinearizeConfig().to_dict()


@pytest.mark.parametrize("config", [
    BlendConfig(),
    BlendConfig(init_slope=0.25, exclude_modules=["fc"], channel_dim=-1, activations=("relu",)),
    GatedConfig(),
    GatedConfig(mode="dlgn", beta=2.5, value_input="ones", init="copy", hard_gates=True, freeze_feature=True,
                target_modules=["1"], gates="include"),
])
def test_to_dict_from_dict_round_trips_through_json(config):
    d = json.loads(json.dumps(config.to_dict()))
    assert d["mode"] == config.mode
    for cls in (LinearizeConfig, type(config)):
        back = cls.from_dict(d)
        assert type(back) is type(config) and back == config


@pytest.mark.parametrize("mode, expected", [
    ("prelu", BlendConfig(activations=("relu", "gelu"))),
    ("dgn", GatedConfig(activations=("relu", "gelu"), beta=4.0)),
    ("dlgn", GatedConfig(mode="dlgn", activations=("relu", "gelu"), beta=10.0)),
])
def test_old_single_config_dicts_load(mode, expected):
    fields = {"mode": mode} | ({"beta": expected.beta} if mode != "prelu" else {})
    assert LinearizeConfig.from_dict(old_dict(**fields)) == expected
    # without mode it was a prelu config
    if mode == "prelu":
        d = old_dict()
        d.pop("mode")
        assert LinearizeConfig.from_dict(d) == expected


def test_a_pickle_of_the_old_config_loads_as_its_mode_config():
    obj = BlendConfig()
    obj.__dict__ = old_dict(mode="dlgn", beta=2.0, value_input="ones")  # the old class's state: every field
    raw = pickle.dumps(obj, protocol=2)  # the class by name (GLOBAL): rename it to the old class
    assert raw.count(b"\nBlendConfig\n") == 1
    loaded = pickle.loads(raw.replace(b"\nBlendConfig\n", b"\nLinearizeConfig\n"))
    assert type(loaded) is GatedConfig and loaded == GatedConfig(mode="dlgn", activations=("relu", "gelu"), beta=2.0,
                                                                value_input="ones")
    assert pickle.loads(pickle.dumps(loaded)) == loaded and copy.deepcopy(loaded) == loaded


def test_a_sidecar_saved_with_the_old_config_dict_loads(tmp_path):
    model = linearize.convert(mlp(), example_inputs=X)
    with torch.no_grad():
        model[1].slope.copy_(torch.linspace(0, 1, 8))
    linearize.save_pretrained(model, tmp_path)
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    meta["config"] = old_dict(activations=list(meta["config"]["activations"]))
    (tmp_path / CONFIG_NAME).write_text(json.dumps(meta))
    loaded = linearize.from_pretrained(mlp(), tmp_path, example_inputs=X)
    assert type(loaded.linearize_config) is BlendConfig
    assert torch.equal(loaded[1].slope, torch.linspace(0, 1, 8))


@pytest.mark.parametrize("mode, option, value", [
    ("prelu", "beta", 2.0), ("prelu", "value_input", "ones"), ("prelu", "init", "copy"),
    ("prelu", "hard_gates", True), ("prelu", "freeze_feature", True),
    ("dgn", "init_slope", 0.5), ("dlgn", "init_slope", 0.5),
])
def test_an_option_of_another_method_names_the_option_and_the_mode(mode, option, value):
    pattern = rf"'{option}' is an option of mode .*not of mode '{mode}'"
    with pytest.raises(TypeError, match=pattern):
        LinearizeConfig(mode=mode, **{option: value})
    with pytest.raises(TypeError, match=pattern):
        linearize.convert(mlp(), mode=mode, example_inputs=X, **{option: value})
    with pytest.raises(TypeError, match=pattern):
        linearize.convert(mlp(), {"mode": mode, option: value}, example_inputs=X)
    cls = BlendConfig if mode == "prelu" else GatedConfig
    with pytest.raises(TypeError, match=pattern):
        cls(**({"mode": mode} if mode == "dlgn" else {}), **{option: value})
    with pytest.raises(TypeError, match=pattern):  # also a new dict (no `extra`) that mixes methods
        LinearizeConfig.from_dict({**LinearizeConfig(mode=mode).to_dict(), option: value})


def test_unknown_options_and_wrong_modes_are_refused():
    with pytest.raises(TypeError, match="unknown BlendConfig option 'extra'"):
        LinearizeConfig(extra={})
    with pytest.raises(ValueError, match="mode must be one of"):
        LinearizeConfig(mode="gelu")
    with pytest.raises(ValueError, match="mode 'dgn' takes a GatedConfig"):
        BlendConfig(mode="dgn")
    with pytest.raises(ValueError, match="mode 'prelu' takes a BlendConfig"):
        GatedConfig(mode="prelu")


def test_replace_keeps_the_shared_fields_across_methods():
    blend = BlendConfig(init_slope=0.5, exclude_modules=["fc"], gates="include")
    gated = blend.replace(mode="dlgn", hard_gates=True)
    assert gated == GatedConfig(mode="dlgn", exclude_modules=["fc"], gates="include", hard_gates=True)
    assert gated.replace(mode="prelu") == BlendConfig(exclude_modules=["fc"], gates="include")
    assert blend.replace(init_slope=0.0) == BlendConfig(exclude_modules=["fc"], gates="include")
    assert blend.init_slope == 0.5  # a copy


def test_the_config_type_selects_the_method_and_says_whether_the_model_is_new():
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gated = linearize.convert(model, GatedConfig(mode="dlgn", init="copy"), example_inputs=X)
    assert isinstance(gated, GatedNetwork) and gated.linearize_config.mode == "dlgn"
    assert linearize.units(model) == [] and isinstance(model[1], nn.ReLU)  # the model itself is untouched
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())

    converted = linearize.convert(model, BlendConfig(init_slope=0.5), example_inputs=X)
    assert converted is model and type(model.linearize_config) is BlendConfig  # in place
    assert [float(u.slope[0].detach()) for _, u in linearize.units(model)] == [0.5, 0.5]

    # a GatedConfig with a mode override to "prelu" keeps the site selection and drops the gated options
    other = linearize.convert(mlp(), GatedConfig(exclude_modules=["3"], beta=2.0), example_inputs=X, mode="prelu")
    assert type(other.linearize_config) is BlendConfig and [n for n, _ in linearize.units(other)] == ["1"]


def test_a_subclass_of_a_method_config_uses_that_method_and_others_are_refused():
    @dataclasses.dataclass
    class MyBlend(BlendConfig):
        note: str = ""

    model = linearize.convert(mlp(), MyBlend(note="x", init_slope=1.0), example_inputs=X)
    with torch.no_grad():  # slopes 1: the identity, so the network is affine
        torch.testing.assert_close(model(X), model[4](model[2](model[0](X))))

    @dataclasses.dataclass
    class Unhandled(LinearizeConfig):
        modes = ("prelu",)

    with pytest.raises(TypeError, match="no conversion method for Unhandled"):
        linearize.convert(mlp(), Unhandled(), example_inputs=X)


def test_replace_mode_takes_the_new_modes_default_beta():
    """Truth (GatedConfig docs): ``beta=None`` takes the mode's default, 4 for DGN and 10 for DLGN; a
    config built as DGN with no beta given, switched to DLGN with ``replace``, must equal
    ``LinearizeConfig(mode="dlgn")`` (beta 10). Observed: beta 4.0 carried over (it was filled in
    ``__post_init__``, not given by the user)."""
    switched = linearize.LinearizeConfig(mode="dgn").replace(mode="dlgn")
    assert switched.beta == linearize.LinearizeConfig(mode="dlgn").beta == 10.0


def test_subclass_from_dict_of_another_modes_dict_names_the_right_fix():
    """Truth: ``from_dict`` reads ``d["mode"]``; ``BlendConfig.from_dict`` of a DGN dict must either
    return that mode's config or say the dict is of mode 'dgn' and point at ``LinearizeConfig.from_dict``.
    Observed: "'beta' is an option of mode 'dgn'/'dlgn' (GatedConfig), not of mode 'dgn' (BlendConfig)"
    (the config names the wrong class for its own mode, and the suggested fix, convert with mode='dgn',
    is what the dict already says)."""
    from linearize.config import BlendConfig, GatedConfig

    d = GatedConfig(mode="dgn").to_dict()
    try:
        cfg = BlendConfig.from_dict(d)
    except (TypeError, ValueError) as err:
        assert "not of mode 'dgn'" not in str(err)
        assert "LinearizeConfig.from_dict" in str(err)
    else:
        assert cfg == GatedConfig(mode="dgn")


def test_gated_bool_options_refuse_strings():
    """Truth: ``hard_gates`` and ``freeze_feature`` are booleans. A hand-edited or crafted config dict with
    ``"hard_gates": "false"`` must be refused (TypeError/ValueError naming the option), not read as the
    truthy string, which turns hard gates *on*. Observed: accepted, ``cfg.hard_gates == "false"``."""
    with pytest.raises((TypeError, ValueError), match="hard_gates"):
        linearize.LinearizeConfig.from_dict({"mode": "dgn", "hard_gates": "false"})
