"""``LinearizeConfig``: what ``linearize.convert`` converts and how (a JSON-serializable dataclass)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .activations import DEFAULT_ACTIVATIONS
from .checks import as_patterns, check_channel_dim

MODES = ("prelu", "dgn", "dlgn")
DEFAULT_BETA = {"dgn": 4.0, "dlgn": 10.0}
GATES = ("exclude", "include")


@dataclass
class LinearizeConfig:
    """Options of :func:`linearize.convert`.

    Attributes:
        mode: ``"prelu"`` (blend units, the default), ``"dgn"`` or ``"dlgn"`` (gated splits).
        activations: activation kinds to convert (names as in ``DEFAULT_ACTIVATIONS``).
        target_modules: only convert activation modules whose qualified name matches one of these
            (a regex by ``re.fullmatch``, or a plain suffix such as ``"intermediate.intermediate_act_fn"``).
            One string is one pattern (``"13"`` matches a module named ``13``, not ``1`` or ``3``).
            ``None`` converts all.
        exclude_modules: never convert modules matching these (same rules); wins over targets.
        init_slope: initial slope of every unit (0 keeps the original function exactly).
        channel_dim: force the channel dimension of every unit (not 0, the batch dimension; checked
            against each call's input when converting); ``None`` infers it per call site
            (1 after convs and batch norms and for inputs of 4+ dims, -1 after linear layers).
        beta: gate sharpness of ``sigmoid(beta * q)`` for gated modes (default 4 DGN, 10 DLGN).
        value_input: gated modes: feed the value network ``"x"`` or a constant ``"ones"`` input.
        init: gated modes: ``"independent"`` (fresh feature weights) or ``"copy"`` (from the model).
        hard_gates: gated modes: use the step ``q > 0`` instead of a sigmoid.
        freeze_feature: gated modes: keep the feature (gating) network fixed ("fixed learnt gates").
        gates: ``"exclude"`` (default) leaves multiplicative gates unconverted, ``"include"``
            converts them like any activation. A call is a gate when, in the probe forward, its
            output (or a view of it) multiplies another tensor and either its kind is in
            ``GATE_KINDS`` (sigmoid, hardsigmoid: squeeze-excitation, attention and GLU gates,
            ``x * sigmoid(x)``) or it is broadcast over the other factor (a ``[N, C, 1, 1]``
            channel gate of any kind). Making a gate linear leaves a product, not a linear map, so
            excluded gates are not units and not counted; ``model.linearize_report.gates`` lists
            them with the reason. GLU-style products of same-shaped tensors with other kinds
            (SwiGLU/GeGLU MLPs) are not gates: that activation is the MLP's nonlinearity.
    """

    mode: str = "prelu"
    activations: tuple[str, ...] = DEFAULT_ACTIVATIONS
    target_modules: list[str] | None = None
    exclude_modules: list[str] | None = None
    init_slope: float = 0.0
    channel_dim: int | None = None
    beta: float | None = None
    value_input: str = "x"
    init: str = "independent"
    hard_gates: bool = False
    freeze_feature: bool = False
    gates: str = "exclude"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        self.activations = tuple(self.activations)
        unknown = set(self.activations) - set(DEFAULT_ACTIVATIONS)
        if unknown:
            raise ValueError(f"unknown activation kinds {sorted(unknown)}; known: {DEFAULT_ACTIVATIONS}")
        if not 0.0 <= self.init_slope <= 1.0:
            raise ValueError(f"init_slope must lie in [0, 1], got {self.init_slope}")
        self.target_modules = as_patterns(self.target_modules, "target_modules")
        self.exclude_modules = as_patterns(self.exclude_modules, "exclude_modules")
        if self.channel_dim is not None:
            self.channel_dim = check_channel_dim(self.channel_dim)
        if self.beta is None and self.mode in DEFAULT_BETA:
            self.beta = DEFAULT_BETA[self.mode]
        if self.beta is not None and not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"beta must be a finite number > 0, got {self.beta}")
        if self.value_input not in ("x", "ones"):
            raise ValueError(f"value_input must be 'x' or 'ones', got {self.value_input!r}")
        if self.gates not in GATES:
            raise ValueError(f"gates must be one of {GATES}, got {self.gates!r}")
        if self.init not in ("independent", "copy"):
            raise ValueError(f"init must be 'independent' or 'copy', got {self.init!r}")

    def to_dict(self) -> dict:
        """Plain JSON-serializable dict."""
        d = dataclasses.asdict(self)
        d["activations"] = list(self.activations)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LinearizeConfig":
        """Inverse of :meth:`to_dict`; unknown keys raise ``TypeError``."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise TypeError(f"unknown LinearizeConfig fields {sorted(unknown)}")
        return cls(**d)
