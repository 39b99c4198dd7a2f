"""The one activation table: which modules and functions are activations, of which kind.

Every module that needs to recognise an activation reads it here: :func:`linearize.convert` (module
and functional call sites, :mod:`~linearize.functional_sites`), the gated split, fold and the
reports. A *kind* is a short name (``"relu"``, ``"gelu"`` ...); :data:`DEFAULT_ACTIVATIONS` lists those
``convert`` swaps by default, :data:`GATE_KINDS` those that usually gate another tensor.

- :data:`MODULE_KINDS`: torch modules (exact type); :data:`HF_KINDS` / :data:`TIMM_KINDS`: the
  activation classes of transformers and timm, by class name (neither is imported here);
- :data:`FUNCTIONAL_SPECS`: functions and tensor methods (in-place forms included), with
  :func:`activation_module` building the module a functional call computes, and
  :data:`FUNCTIONS_BY_NAME` naming its out-of-place functions (for folded saves);
- :data:`OTHER_ELEMENTWISE` / :data:`OTHER_FUNCTIONS`: elementwise activation modules and functions
  ``convert`` does not swap (PReLU, Softsign...): its report names them;
- :class:`FunctionalActivation`: a module wrapping an activation function held as an attribute.

Example:
    >>> activation_kind(nn.GELU()), activation_kind(F.relu), activation_kind(nn.Linear(2, 2))
    ('gelu', 'relu', None)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DEFAULT_ACTIVATIONS", "GATE_KINDS", "MODULE_KINDS", "HF_KINDS", "TIMM_KINDS", "FUNCTIONAL_SPECS",
           "FUNCTIONS_BY_NAME", "OTHER_ELEMENTWISE", "OTHER_FUNCTIONS", "INPLACE_ARG", "activation_kind", "activation_module",
           "FunctionalActivation", "call_arg", "in_place", "negative_slope"]

DEFAULT_ACTIVATIONS = (
    "relu", "relu6", "leaky_relu", "gelu", "silu", "hardswish", "mish", "elu", "celu", "selu",
    "softplus", "tanh", "sigmoid", "hardsigmoid", "hardtanh", "quick_gelu", "relu2",
)
GATE_KINDS = ("sigmoid", "hardsigmoid")  # squashing into [0, 1]: their role is to scale another tensor

MODULE_KINDS: list[tuple[type, str]] = [
    (nn.ReLU6, "relu6"),  # before Hardtanh, its base class
    (nn.ReLU, "relu"),
    (nn.LeakyReLU, "leaky_relu"),
    (nn.GELU, "gelu"),
    (nn.SiLU, "silu"),
    (nn.Hardswish, "hardswish"),
    (nn.Mish, "mish"),
    (nn.ELU, "elu"),
    (nn.CELU, "celu"),
    (nn.SELU, "selu"),
    (nn.Softplus, "softplus"),
    (nn.Tanh, "tanh"),
    (nn.Sigmoid, "sigmoid"),
    (nn.Hardsigmoid, "hardsigmoid"),
    (nn.Hardtanh, "hardtanh"),
]
# transformers.activations classes by name (no import of transformers needed)
HF_KINDS = {
    "GELUActivation": "gelu",
    "NewGELUActivation": "gelu",
    "FastGELUActivation": "gelu",
    "GELUTanh": "gelu",
    "PytorchGELUTanh": "gelu",
    "AccurateGELUActivation": "gelu",
    "ClippedGELUActivation": "gelu",
    "QuickGELUActivation": "quick_gelu",
    "SiLUActivation": "silu",
    "MishActivation": "mish",
    "ReLUSquaredActivation": "relu2",
}
# timm's own activation modules (timm.layers.activations[_me]) by name: they call F.gelu etc. inside
TIMM_KINDS = {
    "GELU": "gelu", "GELUTanh": "gelu", "QuickGELU": "quick_gelu", "Sigmoid": "sigmoid", "Tanh": "tanh",
    "Swish": "silu", "SwishMe": "silu", "Mish": "mish", "MishMe": "mish", "HardSigmoid": "hardsigmoid",
    "HardSigmoidMe": "hardsigmoid", "HardSwish": "hardswish", "HardSwishMe": "hardswish",
}

# intercepted function -> (kind, always in place)
FUNCTIONAL_SPECS: dict[Callable, tuple[str, bool]] = {
    F.relu: ("relu", False), torch.relu: ("relu", False), torch.Tensor.relu: ("relu", False),
    torch.relu_: ("relu", True), torch.Tensor.relu_: ("relu", True),  # F.relu_ is torch.relu_
    F.relu6: ("relu6", False),
    F.leaky_relu: ("leaky_relu", False), F.leaky_relu_: ("leaky_relu", True),
    F.gelu: ("gelu", False), F.silu: ("silu", False), F.hardswish: ("hardswish", False), F.mish: ("mish", False),
    F.elu: ("elu", False), F.elu_: ("elu", True), F.celu: ("celu", False), F.selu: ("selu", False),
    torch.celu: ("celu", False), torch.celu_: ("celu", True), torch.selu: ("selu", False), torch.selu_: ("selu", True),
    F.softplus: ("softplus", False), F.hardtanh: ("hardtanh", False), F.hardtanh_: ("hardtanh", True),
    F.hardsigmoid: ("hardsigmoid", False),
    torch.tanh: ("tanh", False), F.tanh: ("tanh", False), torch.Tensor.tanh: ("tanh", False),
    torch.tanh_: ("tanh", True), torch.Tensor.tanh_: ("tanh", True),
    torch.sigmoid: ("sigmoid", False), F.sigmoid: ("sigmoid", False), torch.Tensor.sigmoid: ("sigmoid", False),
    torch.sigmoid_: ("sigmoid", True), torch.Tensor.sigmoid_: ("sigmoid", True),
}


def _qualified_name(func: Callable) -> str | None:
    """``torch.nn.functional.<name>`` or ``torch.<name>`` for a function of those namespaces, else None."""
    name = getattr(func, "__name__", "")
    for prefix, namespace in (("torch.nn.functional", F), ("torch", torch)):
        if getattr(namespace, name, None) is func:
            return f"{prefix}.{name}"
    return None


# the out-of-place activation functions of FUNCTIONAL_SPECS (no tensor methods) by qualified name, as
# folded saves record the function a FunctionalActivation holds ("torch.nn.functional.gelu", "torch.tanh")
FUNCTIONS_BY_NAME: dict[str, Callable] = {
    name: func for func, (_, inplace) in FUNCTIONAL_SPECS.items()
    if not inplace and (name := _qualified_name(func)) is not None
}
# elementwise activation modules that are not MODULE_KINDS (convert leaves them alone; measures read them)
OTHER_ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.PReLU, nn.RReLU, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid, nn.Threshold, nn.Softshrink, nn.Hardshrink,
)
# position of the ``inplace`` argument of a kind's functional form (absent: none)
# their functional forms (and torch's): recorded by convert's probe as nonlinear calls it leaves as they are
OTHER_FUNCTIONS: tuple[Callable, ...] = (
    F.prelu, torch.prelu, F.rrelu, F.softsign, F.tanhshrink, F.logsigmoid, F.threshold, F.softshrink, F.hardshrink,
)
INPLACE_ARG = {"relu": 1, "relu6": 1, "leaky_relu": 2, "elu": 2, "celu": 2, "selu": 1, "hardtanh": 3,
                "hardsigmoid": 1, "hardswish": 1, "silu": 1, "mish": 1}


def call_arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    """The argument ``name`` (at position ``index``) of a call ``func(*args, **kwargs)``, else ``default``.

    Example:
        >>> call_arg((1.0, 0.2), {}, 1, "negative_slope", 0.01), call_arg((1.0,), {}, 1, "negative_slope", 0.01)
        (0.2, 0.01)
    """
    return kwargs.get(name, args[index] if len(args) > index else default)


def in_place(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether the call ``func(*args, **kwargs)`` of an activation of :data:`FUNCTIONAL_SPECS` writes into its input.

    Example:
        >>> in_place(F.relu, (torch.ones(2),), {"inplace": True}), in_place(torch.relu_, (torch.ones(2),), {})
        (True, True)
    """
    kind, always = FUNCTIONAL_SPECS[func]
    return always or (kind in INPLACE_ARG and bool(call_arg(args, kwargs, INPLACE_ARG[kind], "inplace", False)))


# the arguments after the input of a kind's functional form, in order, with their defaults: the same names as
# the attributes of the kind's module (``F.leaky_relu(x, 0.2)`` <-> ``nn.LeakyReLU(0.2).negative_slope``)
CALL_ARGUMENTS: dict[str, tuple[tuple[str, Any], ...]] = {
    "leaky_relu": (("negative_slope", 0.01),), "gelu": (("approximate", "none"),), "elu": (("alpha", 1.0),),
    "celu": (("alpha", 1.0),), "softplus": (("beta", 1.0), ("threshold", 20.0)),
    "hardtanh": (("min_val", -1.0), ("max_val", 1.0)),
}
_MODULES = {"relu": nn.ReLU, "relu6": nn.ReLU6, "silu": nn.SiLU, "hardswish": nn.Hardswish, "mish": nn.Mish,
            "selu": nn.SELU, "hardsigmoid": nn.Hardsigmoid, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid,
            "leaky_relu": nn.LeakyReLU, "gelu": nn.GELU, "elu": nn.ELU, "celu": nn.CELU, "softplus": nn.Softplus,
            "hardtanh": nn.Hardtanh}


def call_arguments(func: Callable, args: tuple, kwargs: dict) -> tuple:
    """The arguments after the input of the functional activation call ``func(*args, **kwargs)`` that change what
    it computes (not ``inplace``), as ``(name, value)`` pairs with defaults filled in: two calls compute the
    same function exactly when these are equal.

    Example:
        >>> call_arguments(F.leaky_relu, (torch.ones(2), 0.2), {}), call_arguments(F.relu, (torch.ones(2),), {})
        ((('negative_slope', 0.2),), ())
    """
    spec = CALL_ARGUMENTS.get(FUNCTIONAL_SPECS[func][0], ())
    return tuple((name, _plain(call_arg(args, kwargs, i + 1, name, default))) for i, (name, default) in enumerate(spec))


def module_arguments(act: nn.Module) -> tuple:
    """:func:`call_arguments` of the functional call that the activation module ``act`` computes.

    Example:
        >>> module_arguments(nn.LeakyReLU(0.2)) == call_arguments(F.leaky_relu, (torch.ones(2), 0.2), {})
        True
    """
    return tuple((name, _plain(getattr(act, name))) for name, _ in CALL_ARGUMENTS.get(activation_kind(act), ()))


def _plain(value: Any) -> Any:
    """A call argument as a plain Python value (a number held in a 0-d tensor becomes that number)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value if isinstance(value, str) else float(value)


def activation_module(func: Callable, args: tuple, kwargs: dict) -> nn.Module:
    """The activation module computing the functional call ``func(*args, **kwargs)`` (never in place).

    Example:
        >>> activation_module(F.leaky_relu, (torch.ones(2), 0.2), {})
        LeakyReLU(negative_slope=0.2)
    """
    return _MODULES[FUNCTIONAL_SPECS[func][0]](**dict(call_arguments(func, args, kwargs)))


def negative_slope(act: object) -> float | None:
    """The slope on the negative side of a ReLU-family activation (a module, a function or a
    :class:`FunctionalActivation`): 0 for ReLU and ReLU6, an ``nn.LeakyReLU``'s ``negative_slope``
    (0.01, ``F.leaky_relu``'s default, for the function); ``None`` for any other activation.

    Example:
        >>> negative_slope(nn.LeakyReLU(0.2)), negative_slope(F.relu), negative_slope(F.leaky_relu), negative_slope(nn.GELU())
        (0.2, 0.0, 0.01, None)
    """
    if isinstance(act, nn.LeakyReLU):
        return float(act.negative_slope)
    if isinstance(act, nn.ReLU):
        return 0.0
    return {"relu": 0.0, "relu6": 0.0, "leaky_relu": 0.01}.get(activation_kind(act))


class FunctionalActivation(nn.Module):
    """Module wrapper of an activation function held as a plain attribute (``self.act = F.gelu``)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], kind: str, where: str = "") -> None:
        super().__init__()
        self.fn = fn
        self.kind = kind
        self.where = where  # "Owner.attribute" it was held as

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs:  # its unit would take the input alone: refuse before anything is swapped
            name = getattr(self.fn, "__name__", "the function")
            given = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
            raise TypeError(
                f"linearize: the activation function {name} held as the attribute {self.where or 'of a module'} is "
                f"called with arguments ({given}); linearize converts such an attribute as a module of the input "
                f"alone. Fix: hold a module with those settings instead (e.g. nn.GELU(approximate='tanh'), "
                f"nn.LeakyReLU(0.2)), or call {name}(x, {given}) inline in forward, which converts with its arguments")
        return self.fn(x)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))


def activation_kind(obj: object) -> str | None:
    """The kind name of an activation module or function, or ``None`` if it is not one."""
    if isinstance(obj, nn.Module):
        if isinstance(obj, FunctionalActivation):
            return obj.kind
        for cls, kind in MODULE_KINDS:
            if type(obj) is cls:
                return kind
        if type(obj).__module__.startswith("transformers"):
            return HF_KINDS.get(type(obj).__name__)
        if type(obj).__module__.startswith("timm.layers.activations"):
            return TIMM_KINDS.get(type(obj).__name__)
        return None
    try:
        spec = FUNCTIONAL_SPECS.get(obj)  # type: ignore[arg-type]
    except TypeError:  # unhashable
        return None
    return spec[0] if spec is not None else None
