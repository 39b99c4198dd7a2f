"""LinearizableActivation.prelu_weight / plain_activation against the definitions (float64, on a grid),
and the shared helpers they replaced: map_tensors, the activation tables of deploy and affinity."""

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import linearize
from linearize.activations import FUNCTIONS_BY_NAME
from linearize.inputs import map_tensors, to_device
from linearize.unit import ChannelBlend, ChannelPReLU, LinearizableActivation
from test_unit import computes_the_original_on_integers

C = 5
GRID = torch.linspace(-4, 4, 81, dtype=torch.float64)


def grid_input(channel_dim: int) -> torch.Tensor:
    """``[2, C, 81]`` (channels at 1) or ``[2, 81, C]`` (at -1): every channel sees the whole grid."""
    x = GRID.expand(2, C, -1).clone()
    return x if channel_dim == 1 else x.transpose(1, 2).contiguous()


def unit_with(act, slopes: torch.Tensor, channel_dim: int = 1) -> LinearizableActivation:
    unit = LinearizableActivation(act, C, channel_dim=channel_dim).double()
    with torch.no_grad():
        unit.slope.copy_(slopes)
    return unit


def blend(act, x: torch.Tensor, a: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """The definition ``(1 - a) * act(x) + a * x``, ``a`` along ``channel_dim``."""
    shape = [1] * x.ndim
    shape[channel_dim] = C
    a = a.view(shape)
    return (1 - a) * act(x) + a * x


SLOPES = {"zeros": torch.zeros(C), "ones": torch.ones(C), "mixed": torch.tensor([0.0, 0.3, 0.5, 0.9, 1.0])}


@pytest.mark.parametrize("leak", [0.0, 0.01, 0.2])
@pytest.mark.parametrize("channel_dim", [1, -1])
def test_prelu_weight_is_the_negative_slope_of_the_unit(leak, channel_dim):
    a = torch.tensor([0.0, 0.3, 0.5, 0.9, 1.0], dtype=torch.float64)
    unit = unit_with(nn.LeakyReLU(leak) if leak else nn.ReLU(), a, channel_dim)
    w = unit.prelu_weight()
    # the definition: for x < 0 the blend is (1 - a) * leak * x + a * x
    torch.testing.assert_close(w, (1 - a) * leak + a, rtol=0, atol=1e-15)
    x = grid_input(channel_dim)
    ref = F.prelu(x if channel_dim == 1 else x.transpose(1, 2), (1 - a) * leak + a)
    ref = ref if channel_dim == 1 else ref.transpose(1, 2)
    with torch.no_grad():
        torch.testing.assert_close(unit(x), ref, rtol=0, atol=1e-15)
        torch.testing.assert_close(unit(x), blend(lambda t: F.leaky_relu(t, leak), x, a, channel_dim),
                                   rtol=0, atol=1e-15)
    other = torch.tensor([0.25, 0.75], dtype=torch.float64)  # given slopes, any width
    torch.testing.assert_close(unit.prelu_weight(other), (1 - other) * leak + other, rtol=0, atol=1e-15)


def test_prelu_weight_refuses_a_smooth_unit():
    with pytest.raises(TypeError, match="a gelu unit is a blend, not a PReLU"):
        LinearizableActivation(nn.GELU(), C).prelu_weight()


ACTS = {
    "relu": (nn.ReLU(), F.relu, nn.ReLU),
    "leaky_relu": (nn.LeakyReLU(0.1), lambda t: F.leaky_relu(t, 0.1), nn.LeakyReLU),
    "gelu": (nn.GELU(), F.gelu, nn.GELU),
    "tanh": (nn.Tanh(), torch.tanh, nn.Tanh),
    "F.silu": (F.silu, F.silu, linearize.activations.FunctionalActivation),
}


@pytest.mark.parametrize("name", sorted(ACTS))
@pytest.mark.parametrize("slopes", sorted(SLOPES))
@pytest.mark.parametrize("channel_dim", [1, -1])
def test_plain_activation_computes_the_unit_with_no_slope(name, slopes, channel_dim):
    act, fn, zero_type = ACTS[name]
    a = SLOPES[slopes].double()
    unit = unit_with(act, a, channel_dim)
    plain = unit.plain_activation()
    expected_type = {"ones": nn.Identity, "zeros": zero_type}.get(
        slopes, ChannelPReLU if name in ("relu", "leaky_relu") else ChannelBlend)
    assert type(plain) is expected_type
    x = grid_input(channel_dim)
    with torch.no_grad():
        truth = blend(fn, x, a, channel_dim)
        torch.testing.assert_close(plain.double()(x), truth, rtol=0, atol=1e-15)
        unit.slope.fill_(0.5)  # the plain module holds its own copy
        torch.testing.assert_close(plain(x), truth, rtol=0, atol=1e-15)


def test_plain_activation_takes_slopes_of_another_width():
    unit = unit_with(nn.ReLU(), torch.zeros(C, dtype=torch.float64))
    a = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    plain = unit.plain_activation(a)
    x = GRID.expand(2, 3, -1)
    torch.testing.assert_close(plain(x), torch.where(x > 0, x, a.view(1, 3, 1) * x), rtol=0, atol=1e-15)


Pair = collections.namedtuple("Pair", "x meta")


def test_map_tensors_reaches_every_tensor_and_keeps_containers():
    t = torch.ones(2)
    obj = {"a": t, "b": [t, (t, 3)], "c": Pair(t, "keep"), "d": "text"}
    out = map_tensors(obj, lambda v: v * 2)
    assert type(out["c"]) is Pair and out["c"].meta == "keep" and torch.equal(out["c"].x, 2 * t)
    assert type(out["b"]) is list and type(out["b"][1]) is tuple and out["b"][1][1] == 3
    assert torch.equal(out["a"], 2 * t) and torch.equal(out["b"][1][0], 2 * t) and out["d"] == "text"
    moved = to_device(Pair(t.double(), 1), torch.device("cpu"))
    assert type(moved) is Pair and moved.x.dtype == torch.float64
    assert to_device(obj, None) is obj


def test_deploy_and_affinity_read_the_activation_table():
    from linearize import deploy
    from linearize.measures.affinity import STANDARD_ACTIVATIONS

    saved = ["relu", "relu6", "leaky_relu", "gelu", "silu", "hardswish", "mish", "elu", "celu", "selu",
             "softplus", "tanh", "sigmoid", "hardsigmoid", "hardtanh"]  # names folded saves hold
    names = {f"torch.nn.functional.{n}" for n in saved} | {"torch.tanh", "torch.sigmoid", "torch.relu"}
    assert set(FUNCTIONS_BY_NAME) >= names and deploy._FUNCTIONS is FUNCTIONS_BY_NAME
    assert all(FUNCTIONS_BY_NAME[n] is eval(n, {"torch": torch}) for n in names)
    assert not any(n.endswith("_") for n in FUNCTIONS_BY_NAME)  # no in-place forms
    for cls in (nn.ReLU, nn.GELU, nn.Hardtanh, nn.PReLU, nn.Softsign, nn.Hardshrink):
        assert cls in STANDARD_ACTIVATIONS


def test_folded_files_naming_the_fold_modules_module_still_load(tmp_path):
    import json

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    linearize.convert(model, example_inputs=x)
    with torch.no_grad():
        model[1].slope.copy_(torch.tensor([0.0, 0.5, 1.0, 1.0, 0.2, 0.0, 0.0, 0.3]))
    folded = linearize.fold(model, x)
    linearize.save_folded(folded, tmp_path)
    meta = json.loads((tmp_path / "folded.json").read_text())
    classes = [e["class"] for e in meta["modules"]]
    assert "linearize.unit.ChannelPReLU" in classes
    for entry in meta["modules"]:  # as written before ChannelPReLU moved to linearize.unit
        entry["class"] = entry["class"].replace("linearize.unit.", "linearize.folding.modules.")
    (tmp_path / "folded.json").write_text(json.dumps(meta))
    loaded = linearize.load_folded(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("cls", [cls for cls, _ in linearize.activations.MODULE_KINDS])
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("granularity", ["channel", "element"])
def test_plain_forms_on_integer_inputs_give_the_original_or_name_the_dtype_and_the_fix(cls, dtype, granularity):
    """A unit on an integer or bool tensor computes its original activation (or raises a TypeError naming it),
    but its plain form, what fold puts in its place, raised torch's raw errors ("prelu: Type promoting not
    supported", "lerp_kernel_tensor not implemented for 'Long'"): the folded model refused inputs the
    converted model takes. Truth: the original module on the same input; where it raises, a TypeError naming
    the plain form, the dtype and the fix. An in-place one writes into its input, as the original."""
    x = torch.tensor([[-3, -1, 0, 2, 7]]).to(dtype)
    unit = linearize.unit.make_unit(cls(), x.shape, -1, None, 0.0, granularity)
    with torch.no_grad():
        unit.slope.copy_(torch.tensor([0.0, 0.5, 1.0, 0.25, 0.0]))
    plain = unit.plain_activation()
    assert "Channel" in type(plain).__name__ or "Element" in type(plain).__name__
    if not computes_the_original_on_integers(plain, cls, x):
        return
    if cls is nn.ReLU and dtype is torch.int64:
        unit.inplace = True
        given = x.clone()
        assert unit.plain_activation()(given) is given and torch.equal(given, torch.relu(x))


def test_a_saved_folded_prelu_site_computes_relu_on_integer_inputs_after_loading(tmp_path):
    """The negative slope of the activation a folded ChannelPReLU replaced (what integer inputs get) is saved
    with it. Truth: torch.relu on the integer input, and a LeakyReLU site's TypeError (leaky_relu refuses int64)."""
    torch.manual_seed(0)
    x = torch.randn(5, 4)
    for act in (nn.ReLU(), nn.LeakyReLU(0.1)):
        model = linearize.convert(nn.Sequential(nn.Linear(4, 5), act), example_inputs=x)
        with torch.no_grad():
            model[1].slope.copy_(torch.tensor([0.0, 0.5, 1.0, 0.25, 0.0]))
        linearize.save_folded(linearize.fold(model, x), tmp_path / type(act).__name__)
        site = linearize.load_folded(tmp_path / type(act).__name__)[1]
        assert isinstance(site, ChannelPReLU)
        idx = torch.tensor([[-3, -1, 0, 2, 7]])
        if isinstance(act, nn.ReLU):
            assert torch.equal(site(idx), torch.relu(idx))
        else:
            with pytest.raises(TypeError, match=r"ChannelPReLU\(.*dtype torch.int64, which the original activation"):
                site(idx)
