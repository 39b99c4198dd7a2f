"""``guess_example_inputs``: the probe input ``convert`` derives from what a model says about itself, and
the command line's ``--input-shape`` / ``--example-inputs`` for the models that say too little."""

from __future__ import annotations

import pickle
import re
import warnings

import pytest
import timm
import torch
import torch.nn.functional as F
import torchvision
import transformers as hf
from safetensors.torch import save_file
from torch import nn

import linearize
from linearize.cli import main
from linearize.example_inputs import guess_example_inputs, input_layer, load_example_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


def shape(x) -> tuple[int, ...]:
    return tuple(x.shape)


def test_torchvision_vit_converts_without_inputs():
    """The root holds ``class_token``; the input layer is ``conv_proj`` and the size ``model.image_size``."""
    vit = torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=1, num_heads=2,
                                               hidden_dim=16, mlp_dim=32, num_classes=10)
    assert input_layer(vit) is vit.conv_proj
    assert shape(guess_example_inputs(vit)) == (2, 3, 32, 32)
    linearize.convert(vit)
    assert [name for name, _ in linearize.units(vit)] == ["encoder.layers.encoder_layer_0.mlp.1"]


def test_inception_v3_gets_its_smallest_valid_size():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torchvision.models.inception_v3(weights=None, num_classes=10, init_weights=False).eval()
    x = guess_example_inputs(model)
    assert shape(x) == (2, 3, 75, 75)
    with torch.no_grad():
        assert shape(model(x)) == (2, 10)
        with pytest.raises(RuntimeError):  # one pixel less is too small: 75 is the minimum
            model(x[..., :74, :74])


@pytest.mark.parametrize("name, side", [("resnet18", 32), ("alexnet", 63)])
def test_torchvision_cnns_get_the_min_size_of_their_weights(name, side):
    """At least 32 px (``weights.meta['min_size']`` is 1 for ResNet, 63 for AlexNet)."""
    model = torchvision.models.get_model(name, weights=None, num_classes=10).eval()
    x = guess_example_inputs(model)
    assert shape(x) == (2, 3, side, side)
    with torch.no_grad():
        assert shape(model(x)) == (2, 10)


def test_timm_sizes_come_from_the_patch_embedding_then_the_pretrained_cfg():
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=48, depth=1)
    assert shape(guess_example_inputs(vit)) == (2, 3, 48, 48)  # patch_embed.img_size, not the cfg's 224
    cnn = timm.create_model("resnet10t", pretrained=False, num_classes=10, in_chans=1,
                            pretrained_cfg_overlay={"input_size": (3, 40, 40)})
    assert shape(guess_example_inputs(cnn)) == (2, 1, 40, 40)  # channels of the first conv, size of the cfg


class RootParameterFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x):
        return self.body(x) * self.scale


@pytest.mark.parametrize("model, expected, dtype", [
    (RootParameterFirst(), (2, 1, 224, 224), torch.float32),
    (nn.Sequential(nn.Linear(5, 3), nn.ReLU()).double(), (2, 5), torch.float64),
    (nn.Sequential(nn.Conv1d(2, 3, 3), nn.GELU()), (2, 2, 64), torch.float32),
    (nn.Sequential(nn.Embedding(7, 4), nn.ReLU()), (2, 8), torch.int64),
], ids=["conv-after-root-parameter", "linear-float64", "conv1d", "embedding"])
def test_plain_models(model, expected, dtype):
    x = guess_example_inputs(model)
    assert shape(x) == expected and x.dtype == dtype
    if dtype == torch.int64:
        assert 0 <= x.min() and x.max() < 7
    linearize.convert(model)
    assert len(linearize.units(model)) == 1


def test_a_model_without_an_input_layer_is_refused_with_the_fix():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.act = nn.ReLU()

        def forward(self, x):
            return self.act(x * self.w)

    with pytest.raises(ValueError, match=r"cannot guess an input for Scale.*example_inputs=.*--input-shape"):
        linearize.convert(Scale())


# ----------------------------------------------------------------------------- Hugging Face configs


def activation_calls(model, inputs) -> int:
    """Activation calls in one forward, the sites to expect: calls of transformers/torch activation
    modules (hooks), and activation functions called outside them (``F.gelu`` on Whisper's convs)."""
    from torch.overrides import TorchFunctionMode

    functions = {F.relu, torch.relu, F.gelu, F.silu, torch.tanh, torch.sigmoid, torch.Tensor.relu,
                 torch.Tensor.tanh, torch.Tensor.sigmoid}
    calls, depth = [], [0]
    acts = [m for m in model.modules() if type(m).__module__ == "transformers.activations" or isinstance(m, (nn.GELU, nn.ReLU, nn.Tanh))]

    def enter(*_):
        depth[0] += 1
        calls.append(1)

    def leave(*_):
        depth[0] -= 1

    class Functional(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in functions and depth[0] == 0:
                calls.append(1)
            return func(*args, **(kwargs or {}))

    hooks = [h for m in acts for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    with torch.no_grad(), Functional():
        model(**inputs)
    for h in hooks:
        h.remove()
    return len(calls)


def tiny_hf(kind: str):
    small = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
    if kind == "bert":
        return hf.BertModel(hf.BertConfig(vocab_size=50, max_position_embeddings=6, type_vocab_size=3, **small))
    if kind == "t5":
        return hf.T5Model(hf.T5Config(vocab_size=50, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8))
    if kind == "whisper":
        return hf.WhisperModel(hf.WhisperConfig(
            vocab_size=60, num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=6,
            max_target_positions=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1))
    if kind == "wav2vec2":
        return hf.Wav2Vec2Model(hf.Wav2Vec2Config(
            conv_dim=(8, 8), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=4,
            num_conv_pos_embedding_groups=2, **small))
    if kind == "ast":
        return hf.ASTModel(hf.ASTConfig(num_mel_bins=16, max_length=24, patch_size=8, frequency_stride=8,
                                        time_stride=8, **small))
    if kind == "convnext":
        return hf.ConvNextModel(hf.ConvNextConfig(num_channels=1, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], image_size=32))
    if kind == "vit":
        return hf.ViTModel(hf.ViTConfig(image_size=(24, 16), patch_size=8, **small))
    if kind == "clip":
        text = {"vocab_size": 40, "max_position_embeddings": 10, **small}
        vision = {"image_size": 16, "patch_size": 8, **small}
        return hf.CLIPModel(hf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))
    raise KeyError(kind)


@pytest.mark.parametrize("kind, expected", [
    ("bert", {"input_ids": (2, 6), "token_type_ids": (2, 6)}),  # 6 = max_position_embeddings
    ("t5", {"input_ids": (2, 8), "decoder_input_ids": (2, 8)}),
    ("whisper", {"input_features": (2, 8, 12), "decoder_input_ids": (2, 8)}),  # 12 = 2 * max_source_positions
    ("wav2vec2", {"input_values": (2, 90)}),  # 8 frames <- (8 - 1) * 2 + 3 = 17 <- (17 - 1) * 5 + 10 = 90 samples
    ("ast", {"input_values": (2, 24, 16)}),  # max_length frames of num_mel_bins
    ("convnext", {"pixel_values": (2, 1, 32, 32)}),
    ("vit", {"pixel_values": (2, 3, 24, 16)}),
    ("clip", {"input_ids": (2, 8), "pixel_values": (2, 3, 16, 16)}),
])
def test_hugging_face_inputs_from_the_config(kind, expected):
    torch.manual_seed(0)
    model = tiny_hf(kind).eval()
    inputs = guess_example_inputs(model)
    assert {k: shape(v) for k, v in inputs.items()} == expected
    if "token_type_ids" in inputs:
        assert inputs["token_type_ids"].max() < 3
    n_calls = activation_calls(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linearize.convert(model)
    assert len(linearize.units(model)) == n_calls > 0


def test_an_unknown_hugging_face_input_is_refused_with_the_fix():
    class SpeechLike(nn.Module):
        main_input_name = "input_features"
        config = hf.PretrainedConfig()  # no num_mel_bins: not Whisper-like

    with pytest.raises(ValueError, match=r"cannot guess an input for SpeechLike: its main input 'input_features'.*"
                       r"example_inputs=") as info:
        guess_example_inputs(SpeechLike())
    assert "is not one of" not in str(info.value)  # it is one of them: the config lacks num_mel_bins
    assert "config.num_mel_bins (Whisper-like), which its config lacks" in str(info.value)


# ----------------------------------------------------------------------------- files and the command line


def test_load_example_inputs(tmp_path):
    x, ids = torch.randn(2, 3), torch.arange(6).view(2, 3)
    save_file({"x": x}, tmp_path / "one.safetensors")
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "two.safetensors")
    assert torch.equal(load_example_inputs(tmp_path / "one.safetensors"), x)
    two = load_example_inputs(tmp_path / "two.safetensors")
    assert set(two) == {"input_ids", "attention_mask"} and torch.equal(two["input_ids"], ids)
    (tmp_path / "x.pt").write_bytes(pickle.dumps({"x": x}))
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_example_inputs(tmp_path / "x.pt")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_example_inputs(tmp_path / "missing.safetensors")


def test_inspect_a_torchvision_vit_by_name(capsys):
    assert main(["inspect", "vit_b_32"]) == 0
    assert capsys.readouterr().out.startswith("12 sites, 36864 channels converted")  # 12 MLPs of 3072


def test_inspect_input_shape(capsys):
    assert main(["inspect", "resnet18", "--input-shape", "1,3,40,40"]) == 0
    assert capsys.readouterr().out.startswith("17 sites")
    # the shape is what the probe ran on: a model that cannot take it is one line naming the flag, exit status 2
    assert main(["inspect", "resnet18", "--input-shape", "1,4,40,40"]) == 2
    assert re.search(r"--input-shape 1,4,40,40, Tensor\(1, 4, 40, 40\): RuntimeError: .*channels",
                     capsys.readouterr().err)
    with pytest.raises(SystemExit):
        main(["inspect", "resnet18", "--input-shape", "1,three"])


def test_inspect_example_inputs_as_keywords(tmp_path, capsys):
    model = tiny_hf("bert")
    model.save_pretrained(tmp_path / "bert")
    ids = torch.randint(3, 50, (1, 5))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "inputs.safetensors")
    assert main(["inspect", str(tmp_path / "bert"), "--example-inputs", str(tmp_path / "inputs.safetensors")]) == 0
    assert capsys.readouterr().out.startswith("2 sites, 48 channels converted")  # FFN 32, pooler 16


def test_inspect_a_timm_model_by_name(capsys):
    """Not a torchvision builder: built by timm (random init), probed at its pretrained_cfg input size."""
    assert main(["inspect", "resnet10t"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("11 sites") and "conv1.5" in out  # deep stem: conv1.2, conv1.5, act1; 4 BasicBlocks x 2


def test_a_wrong_guessed_input_names_the_guess_and_the_fix():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 2)  # registered first, called last
            self.conv = nn.Conv2d(3, 8, 3)
            self.act = nn.ReLU()

        def forward(self, x):
            return self.fc(self.act(self.conv(x)).mean((2, 3)))

    with pytest.raises(ValueError, match=r"guessed the input of Net as a tensor of shape \(2, 8\).*example_inputs="):
        linearize.convert(Net())
    assert len(list(linearize.units(linearize.convert(Net(), example_inputs=torch.randn(2, 3, 8, 8))))) == 1
