"""The library on a CUDA device: units, dispatch, checkpointing, autocast, fold and saves.

Skipped without a GPU (CI has none); run on one with ``python -m pytest tests/test_cuda.py -n 0``. Each truth is
independent of the library: the original activation or model on the same device, the same model run serially
or without checkpointing, the unfolded model, the model before the save.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import linearize
from test_call_sites import Functional, Reused, assert_checkpointing_gives_the_plain_gradients, random_slopes
from test_unit_exactness import ACTS, assert_same_bits, unit_and_input

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("name,act", ACTS, ids=[n for n, _ in ACTS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_slope_0_is_the_activation_and_slope_1_the_identity_bit_for_bit_on_cuda(name, act, dtype):
    for channel_dim in (1, -1):
        unit, x = unit_and_input(act, dtype, channel_dim, 0.0)
        unit, x = unit.to(CUDA), x.to(CUDA)
        want = act(x.clone())
        assert_same_bits(unit(x.clone()).detach(), want, f"{name} {dtype} channel_dim={channel_dim} a=0")
        with torch.no_grad():
            unit.slope.fill_(1.0)
        assert_same_bits(unit(x.clone()).detach(), x, f"{name} {dtype} channel_dim={channel_dim} a=1")


@pytest.mark.parametrize("name,act", ACTS, ids=[n for n, _ in ACTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_at_slope_0_the_input_gradient_is_the_activations_on_cuda(name, act, dtype):
    """In-place activations (ELU, SELU, CELU) included: the gradient of a unit at slope 0 reaching x is the
    original's wherever that one is finite."""
    unit, x = unit_and_input(act, dtype, 1, 0.0)
    unit = unit.to(CUDA)
    x = x.to(CUDA).nan_to_num(0.5).clamp(-30, 30)  # finite inputs: the gradient is defined
    grads = []
    for f in (lambda t: act(t * 1), lambda t: unit(t * 1)):  # `* 1`: in-place activations never touch a leaf
        leaf = x.clone().requires_grad_(True)
        f(leaf).float().sum().backward()
        grads.append(leaf.grad)
    finite = torch.isfinite(grads[0])
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    assert torch.allclose(grads[1][finite].float(), grads[0][finite].float(), rtol=tol, atol=tol), name


def _threads(model: nn.Module, x: torch.Tensor, reference: torch.Tensor, threads: int = 4,
             reps: int = 10) -> tuple[int, list[str]]:
    """Forwards from ``threads`` threads at once (each on its own CUDA stream): how many differ from
    ``reference`` by more than 1e-5, and the errors raised."""
    wrong, errors = [0], []

    def work() -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(reps):
                try:
                    out = model(x)
                    stream.synchronize()
                    wrong[0] += not torch.allclose(out, reference, rtol=0, atol=1e-5)
                except Exception as e:  # noqa: BLE001 -- counted and shown
                    errors.append(f"{type(e).__name__}: {e}")

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return wrong[0], errors


@pytest.mark.parametrize("cls", [Functional, Reused])
def test_threads_on_cuda_give_the_serial_outputs_for_functional_and_reused_units(cls):
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    model = linearize.convert(cls().eval(), example_inputs=x)
    random_slopes(model)
    model, x = model.to(CUDA), x.to(CUDA)
    with torch.no_grad():
        reference = model(x)
    assert _threads(model, x, reference) == (0, [])


def test_threads_on_a_converted_resnet18_on_cuda_give_the_serial_outputs(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    original = torchvision.models.resnet18(num_classes=5).eval()
    x = torch.randn(8, 3, 64, 64)
    model = linearize.convert(copy.deepcopy(original), example_inputs=x).to(CUDA)
    original, x = original.to(CUDA), x.to(CUDA)
    with torch.no_grad():
        assert torch.allclose(model(x), original(x), rtol=0, atol=1e-5)  # slopes 0: the original function
    random_slopes(model)
    with torch.no_grad():
        reference = model(x)
    assert _threads(model, x, reference) == (0, [])


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("cls", [Functional, Reused])
def test_checkpointing_on_cuda_gives_the_gradients_of_the_plain_run(cls, reentrant):
    assert_checkpointing_gives_the_plain_gradients(cls, reentrant, CUDA)


class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.head = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1), nn.Linear(16, 4)
        self.b1 = nn.BatchNorm2d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.b1(self.c1(x)))
        h = F.silu(self.c2(h))
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_under_autocast_at_slope_0_the_converted_model_is_the_original_forward_and_backward(dtype):
    torch.manual_seed(0)
    original = SmallNet().to(CUDA)
    x = torch.randn(8, 3, 16, 16, device=CUDA)
    model = linearize.convert(copy.deepcopy(original), example_inputs=x)
    outs, grads = [], []
    for net in (original, model):
        with torch.autocast("cuda", dtype=dtype):
            out = net(x)
        out.float().sum().backward()
        outs.append(out.detach())
        grads.append({n: p.grad for n, p in net.named_parameters() if not n.endswith("slope")})
    assert_same_bits(outs[1], outs[0], f"autocast {dtype} logits")
    for n, g in grads[0].items():  # equal values (a unit's 0 * g may be -0 where ReLU's gradient is +0)
        assert torch.equal(grads[1][n], g), f"autocast {dtype} gradient of {n}: {(grads[1][n] - g).abs().max()}"


def test_fold_on_cuda_computes_the_unfolded_function_or_names_tf32():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    model = linearize.convert(torchvision.models.resnet18(num_classes=5).eval(), example_inputs=x)
    units = list(linearize.units(model))
    with torch.no_grad():
        for i, (_, u) in enumerate(units):
            u.slope.fill_(1.0 if i % 2 else 0.0)
    linearize.freeze(model)
    model, x = model.to(CUDA), x.to(CUDA)
    with torch.no_grad():
        want = model(x)
    try:
        small = linearize.fold(model, x)
    except Exception as e:  # noqa: BLE001 -- a refusal must name TF32 while TF32 is on
        assert "TF32" in str(e) or not (torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32), e
        return
    with torch.no_grad():
        got = small(x)
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_a_model_saved_from_cuda_loads_on_the_cpu_with_the_same_outputs(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    model = linearize.convert(torchvision.models.resnet18(num_classes=5).eval(), example_inputs=x)
    random_slopes(model)
    model = model.to(CUDA)
    linearize.save_pretrained(model, tmp_path / "saved")
    loaded = linearize.from_pretrained(torchvision.models.resnet18(num_classes=5).eval(), tmp_path / "saved")
    with torch.no_grad():
        want = model.cpu()(x)
        assert torch.equal(loaded(x), want)
