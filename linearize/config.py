"""Configs of :func:`linearize.convert`, one per method (like PEFT's ``LoraConfig`` / ``IA3Config``).

- :class:`LinearizeConfig`: the base, holding the site selection every method shares
  (``activations``, ``target_modules``, ``exclude_modules``, ``channel_dim``, ``gates``) and ``mode``.
  Calling it is the compatible shortcut: ``LinearizeConfig(mode=...)`` returns the config of that
  mode's method, so ``isinstance(cfg, LinearizeConfig)`` holds for every config.
- :class:`BlendConfig` (``mode="prelu"``): blend units, ``init_slope``, ``granularity``.
- :class:`GatedConfig` (``mode="dgn"`` or ``"dlgn"``): gated splits, ``beta``, ``value_input``,
  ``init``, ``hard_gates``, ``freeze_feature``.

An option of one method passed to another raises ``TypeError`` naming the option and the mode.
``to_dict()`` / ``from_dict()`` round-trip through JSON with the ``mode`` key; ``from_dict`` also
reads the dicts of the single config that came before (every field of every mode plus an unused
``extra``), so old saves load.

Example:
    >>> cfg = LinearizeConfig(mode="dlgn", value_input="ones")
    >>> type(cfg).__name__, cfg.beta, LinearizeConfig.from_dict(cfg.to_dict()) == cfg
    ('GatedConfig', 10.0, True)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from .activations import DEFAULT_ACTIVATIONS
from .checks import as_patterns, check_channel_dim, is_real

__all__ = ["LinearizeConfig", "BlendConfig", "GatedConfig", "MODES", "config_class"]

MODES = ("prelu", "dgn", "dlgn")
DEFAULT_BETA = {"dgn": 4.0, "dlgn": 10.0}
GATES = ("exclude", "include")
GRANULARITIES = ("channel", "element")  # BlendConfig.granularity


def config_class(mode: str) -> type["LinearizeConfig"]:
    """The config class of ``mode`` (``"prelu"``: :class:`BlendConfig`, ``"dgn"``/``"dlgn"``: :class:`GatedConfig`)."""
    for cls in (BlendConfig, GatedConfig):
        if mode in cls.modes:
            return cls
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _check_options(cls: type["LinearizeConfig"], options: dict[str, Any]) -> None:
    """Raise ``TypeError`` for an option ``cls`` does not have, naming the mode that has it."""
    mode = options.get("mode", cls.modes[0])
    for name in sorted(set(options) - _fields(cls)):
        owners = [other for other in (BlendConfig, GatedConfig) if other is not cls and name in _fields(other)]
        if owners:
            modes = "/".join(repr(m) for o in owners for m in o.modes)
            raise TypeError(
                f"{name!r} is an option of mode {modes} ({owners[0].__name__}), not of mode {mode!r} "
                f"({cls.__name__}): drop {name}=, or convert with mode={owners[0].modes[0]!r}"
            )
        raise TypeError(f"unknown {cls.__name__} option {name!r} (mode {mode!r}); options: {sorted(_fields(cls))}")


@dataclass
class LinearizeConfig:
    """Options of :func:`linearize.convert` shared by every method: which activation sites to convert.

    ``LinearizeConfig(mode=..., **options)`` builds the config of that mode (:class:`BlendConfig`
    for ``"prelu"``, the default; :class:`GatedConfig` for ``"dgn"`` / ``"dlgn"``).

    Attributes:
        mode: ``"prelu"`` (blend units, the default), ``"dgn"`` or ``"dlgn"`` (gated splits).
        activations: activation kinds to convert (names as in ``DEFAULT_ACTIVATIONS``).
        target_modules: only convert activation modules whose qualified name matches one of these
            (a regex by ``re.fullmatch``, or a plain suffix such as ``"intermediate.intermediate_act_fn"``).
            One string is one pattern (``"13"`` matches a module named ``13``, not ``1`` or ``3``).
            ``None`` converts all.
        exclude_modules: never convert modules matching these (same rules); wins over targets.
        channel_dim: force the channel dimension of every unit (not 0, the batch dimension; checked
            against each call's input when converting); ``None`` infers it per call site
            (1 after convs and batch norms and for inputs of 4+ dims, -1 after linear layers).
        gates: ``"exclude"`` (default) leaves multiplicative gates unconverted, ``"include"``
            converts them like any activation. A call is a gate when, in the probe forward, its
            output (or a view of it, or it with a scalar added, subtracted, multiplied or divided: a
            hand-written ``relu6(x + 3) / 6``) multiplies another tensor (``*``, ``mul``, ``addcmul``, an
            ``einsum`` that sums none of its letters) and either its kind is in
            ``GATE_KINDS`` (sigmoid, hardsigmoid: squeeze-excitation, attention and GLU gates,
            ``x * sigmoid(x)``) or it is broadcast over the other factor (a ``[N, C, 1, 1]``
            channel gate of any kind). Making a gate linear leaves a product, not a linear map, so
            excluded gates are not units and not counted; ``model.linearize_report.gates`` lists
            them with the reason. GLU-style products of same-shaped tensors with other kinds
            (SwiGLU/GeGLU MLPs) are not gates: that activation is the MLP's nonlinearity.

    Example:
        >>> LinearizeConfig(exclude_modules=["fc"]).init_slope   # a BlendConfig
        0.0
    """

    modes: ClassVar[tuple[str, ...]] = MODES

    mode: str = "prelu"
    activations: tuple[str, ...] = DEFAULT_ACTIVATIONS
    target_modules: list[str] | None = None
    exclude_modules: list[str] | None = None
    channel_dim: int | None = None
    gates: str = "exclude"

    def __new__(cls, *args: Any, **kwargs: Any) -> "LinearizeConfig":
        if cls is LinearizeConfig:  # the shortcut: the mode picks the method's config
            cls = config_class(kwargs.get("mode", args[0] if args else "prelu"))
        _check_options(cls, kwargs)
        return object.__new__(cls)

    def __setstate__(self, state: dict) -> None:  # unpickling, deepcopy
        if "extra" in state:  # a pickle of the single config that came before: its mode's config
            fixed = LinearizeConfig.from_dict(state)
            self.__class__, state = type(fixed), vars(fixed)
        self.__dict__.update(state)

    def __post_init__(self) -> None:
        if self.mode not in self.modes:
            if self.mode in MODES:
                other = config_class(self.mode)
                raise ValueError(f"{type(self).__name__} is for mode {'/'.join(self.modes)}; mode {self.mode!r} "
                                 f"takes a {other.__name__} (or LinearizeConfig(mode={self.mode!r}, ...))")
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        self.activations = tuple(self.activations)
        unknown = set(self.activations) - set(DEFAULT_ACTIVATIONS)
        if unknown:
            raise ValueError(f"unknown activation kinds {sorted(unknown)}; known: {DEFAULT_ACTIVATIONS}")
        self.target_modules = as_patterns(self.target_modules, "target_modules")
        self.exclude_modules = as_patterns(self.exclude_modules, "exclude_modules")
        if self.channel_dim is not None:
            self.channel_dim = check_channel_dim(self.channel_dim)
        if self.gates not in GATES:
            raise ValueError(f"gates must be one of {GATES}, got {self.gates!r}")

    def to_dict(self) -> dict:
        """Plain JSON-serializable dict, with ``mode`` (what :meth:`from_dict` reads back)."""
        d = dataclasses.asdict(self)
        d["activations"] = list(self.activations)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LinearizeConfig":
        """Inverse of :meth:`to_dict`: the config of ``d["mode"]`` (default ``"prelu"``).

        Unknown keys raise ``TypeError``, as do another method's options. A dict of the earlier
        single config (it has an ``extra`` key) loads: its ``extra`` and the other mode's fields,
        which never had an effect, are dropped.
        """
        d = dict(d)
        mode = d.get("mode", "prelu")
        target = config_class(mode) if cls is LinearizeConfig else cls
        if cls is not LinearizeConfig and mode not in cls.modes:
            raise ValueError(f"the dict is of mode {mode!r}, not one of {cls.__name__}'s {cls.modes}; read it with "
                             f"LinearizeConfig.from_dict(d), which picks the mode's config")
        if "extra" in d:  # written before one config per method
            d.pop("extra")
            legacy = _fields(BlendConfig) | _fields(GatedConfig)
            d = {k: v for k, v in d.items() if k in _fields(target) or k not in legacy}
        return target(**d)

    def replace(self, **changes: Any) -> "LinearizeConfig":
        """A copy with ``changes``; a change of ``mode`` to another method keeps only the shared fields.

        Example:
            >>> LinearizeConfig(exclude_modules=["fc"]).replace(mode="dgn").exclude_modules
            ['fc']
        """
        mode = changes.get("mode", self.mode)
        target = type(self) if mode in self.modes else config_class(mode)
        kept = self.to_dict() if target is type(self) else {
            k: v for k, v in self.to_dict().items() if k in _fields(LinearizeConfig)}
        if mode != self.mode and "beta" not in changes and kept.get("beta") == DEFAULT_BETA.get(self.mode):
            kept["beta"] = None  # the old mode's default, not a choice: the new mode's default applies
        return target(**{**kept, **changes})


@dataclass
class BlendConfig(LinearizeConfig):
    """Blend units (``mode="prelu"``): every call site becomes ``(1 - a) * act(x) + a * x``.

    Attributes (besides the site selection of :class:`LinearizeConfig`):
        init_slope: initial slope ``a`` of every unit, in ``[0, 1]`` (0 keeps the original function exactly).
        granularity: ``"channel"`` (the default: one slope per channel, broadcast along ``channel_dim``) or
            ``"element"``: one slope per position of the unit's input map without the batch dim (``C x H x W``
            per image, the "ReLUs" of the private-inference literature), its shape taken from the probe
            forward on ``example_inputs``; the converted model then takes inputs of that size only
            (:class:`~linearize.unit.ElementActivation`).

    Example:
        >>> BlendConfig(init_slope=0.5).to_dict()["mode"]
        'prelu'
    """

    modes: ClassVar[tuple[str, ...]] = ("prelu",)

    init_slope: float = 0.0
    granularity: str = "channel"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_real(self.init_slope) or not 0.0 <= self.init_slope <= 1.0:
            raise ValueError(f"init_slope must be a number in [0, 1], got {self.init_slope!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES} (one slope per channel, or per position of "
                             f"the input map), got {self.granularity!r}")


@dataclass
class GatedConfig(LinearizeConfig):
    """Gated splits (``mode="dgn"`` or ``"dlgn"``, see :mod:`linearize.gated`).

    Attributes (besides the site selection of :class:`LinearizeConfig`):
        mode: ``"dgn"`` (the default here) or ``"dlgn"``.
        beta: gate sharpness of ``sigmoid(beta * q)``; ``None`` takes the mode's default (4 DGN, 10 DLGN).
        value_input: feed the value network ``"x"`` or a constant ``"ones"`` input.
        init: ``"independent"`` (fresh feature weights) or ``"copy"`` (from the model).
        hard_gates: use the step ``q > 0`` instead of a sigmoid.
        freeze_feature: keep the feature (gating) network fixed ("fixed learnt gates").

    Example:
        >>> GatedConfig(mode="dlgn").beta
        10.0
    """

    modes: ClassVar[tuple[str, ...]] = ("dgn", "dlgn")

    mode: str = "dgn"
    beta: float | None = None
    value_input: str = "x"
    init: str = "independent"
    hard_gates: bool = False
    freeze_feature: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta is None:
            self.beta = DEFAULT_BETA[self.mode]
        if not (is_real(self.beta) and math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"beta must be a finite number > 0, got {self.beta!r}")
        for name in ("hard_gates", "freeze_feature"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.value_input not in ("x", "ones"):
            raise ValueError(f"value_input must be 'x' or 'ones', got {self.value_input!r}")
        if self.init not in ("independent", "copy"):
            raise ValueError(f"init must be 'independent' or 'copy', got {self.init!r}")
