"""Fold rules: the protocol, the context a rule sees, the objective, and the ordered registry.

:func:`linearize.fold` walks the model copy bottom-up (children before their parent). At each
module it asks the rules in order: the first whose ``matches(module, ctx)`` is true and whose
``apply(module, ctx)`` returns a module wins, and that module replaces the visited one (it may be
the same module, changed in place). ``apply`` returning ``None`` declines: fold reports it (unless
the rule said why itself) and asks the next rule. Units a rule leaves in place become plain modules
after the walk, so a rule only needs to handle what it can fold.

Order: rules registered with :func:`register_fold_rule` come first (in registration order), then
the built-in ones (:func:`fold_rules` lists them all); ``before=`` places a rule ahead of a named one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable, Protocol, Sequence

import torch
from torch import nn

from ..unit import LinearizableActivation
from .flops import module_flops
from .modules import linear_unit, plain_unit
from .probe import Probe
from .summary import FoldSummary, MergeRecord
from ..timing import median_latency_ms

__all__ = ["Cost", "Objective", "FoldContext", "FoldRule", "register_fold_rule", "unregister_fold_rule", "fold_rules"]


@dataclass(frozen=True)
class Cost:
    """The cost of a candidate: FLOPs (whole ``example_inputs`` batch), sequential layers, parameters."""

    flops: float = 0.0
    layers: int = 0
    params: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.layers + other.layers, self.params + other.params)


_KEYS: dict[str, Callable[[Cost], tuple]] = {
    "flops": lambda c: (c.flops, c.layers, c.params),
    "depth": lambda c: (c.layers, c.flops, c.params),
    "params": lambda c: (c.params, c.flops, c.layers),
}


@dataclass(frozen=True)
class Objective:
    """What fold minimises when it chooses between candidates (merge or keep, split an FFN or not).

    ``"flops"``: FLOPs, then layers. ``"depth"``: the number of sequential layers, then FLOPs (it
    also merges two zero-padded convs into a :class:`~linearize.folding.conv.BorderExactConv`, which
    the others refuse: a 5x5 costs more than two 3x3). ``"params"``: parameters, then FLOPs.
    ``fold(..., objective="flops")`` is ``Objective("flops")``.

    Example:
        >>> Objective.of("depth").better(Cost(flops=10, layers=1), Cost(flops=5, layers=2))
        True
    """

    name: str = "flops"

    def __post_init__(self) -> None:
        if self.name not in _KEYS:
            raise ValueError(f"objective must be one of {tuple(_KEYS)}, got {self.name!r}")

    @classmethod
    def of(cls, value: "str | Objective") -> "Objective":
        """``value`` as an :class:`Objective` (a name or an Objective)."""
        if isinstance(value, Objective):
            return value
        if not isinstance(value, str):
            raise ValueError(f"objective must be one of {tuple(_KEYS)} or an Objective, got {value!r}")
        return cls(value)

    def key(self, cost: Cost) -> tuple:
        """Sort key of ``cost``: smaller is better."""
        return _KEYS[self.name](cost)

    def better(self, a: Cost, b: Cost) -> bool:
        """Whether ``a`` is strictly better than ``b``."""
        return self.key(a) < self.key(b)

    @property
    def border_exact(self) -> bool:
        """Whether two zero-padded convs may merge with a border correction (``"depth"`` only)."""
        return self.name == "depth"

    def __str__(self) -> str:
        return self.name


@dataclass
class FoldContext:
    """What a rule sees: the objective, ``tol``, the probe forward's record, the summary to report
    to, ``name``, the qualified name of the module being visited (``""`` for the root), ``rule``, the
    name of the rule being applied, and ``time_merges``: whether :meth:`keep_merge` times merges."""

    objective: Objective
    tol: float
    probe: Probe
    summary: FoldSummary
    name: str = ""
    rule: str = ""
    time_merges: bool = False

    def at(self, name: str) -> "FoldContext":
        """This context for the module at ``name``."""
        return replace(self, name=name)

    def site(self, attr: str) -> str:
        """The qualified name of the visited module's attribute ``attr``."""
        return f"{self.name}.{attr}" if self.name else attr

    def once(self, m: nn.Module) -> bool:
        """Whether ``m`` ran exactly once on ``example_inputs`` (a layer reused elsewhere cannot change)."""
        return self.probe.once(m)

    def is_linear(self, m: nn.Module) -> bool:
        """Whether ``m`` is a unit whose channels are all linear (within ``tol``): the identity."""
        return linear_unit(m, self.tol)

    def plain(self, unit: LinearizableActivation) -> nn.Module:
        """The plain module computing ``unit`` (``nn.Identity`` when all linear, ``nn.ReLU``, ...)."""
        return plain_unit(unit, self.tol)

    def flops(self, m: nn.Module) -> int:
        """FLOPs of ``m``'s call on ``example_inputs`` (linear layers; 0 for others or unknown shapes)."""
        out, inp = self.probe.out_shape.get(id(m)), self.probe.in_shape.get(id(m))
        if out is None or inp is None:
            return 0
        return module_flops(m, (torch.empty(inp, device="meta"),), torch.empty(out, device="meta"))

    def cost(self, *layers: nn.Module) -> Cost:
        """The cost of running ``layers`` one after the other, as they ran on ``example_inputs``."""
        return Cost(
            float(sum(self.flops(m) for m in layers)), len(layers),
            float(sum(p.numel() for m in layers for p in m.parameters())),
        )

    def better(self, a: Cost, b: Cost) -> bool:
        """Whether ``a`` is better than ``b`` under the objective."""
        return self.objective.better(a, b)

    def merged(self, what: str, site: str | None = None) -> None:
        """Report a change: ``"<site>: <what>"`` (site defaults to the visited module)."""
        self.summary.merged.append(f"{self.name if site is None else site}: {what}")

    def skipped(self, why: str, site: str | None = None) -> None:
        """Report something left as is and why."""
        self.summary.skipped.append(f"{self.name if site is None else site}: {why}")

    def keep_merge(
        self, what: str, pieces: list[nn.Module], merged: nn.Module, flops: tuple[float, float], site: str | None = None
    ) -> bool:
        """Whether to keep a merge that the objective chose (``pieces``, applied in order, as the one
        layer ``merged``; ``flops``: before and after), recorded in ``summary.merges`` and reported.

        With ``time_merges`` both are timed on a batch-1 input of the recorded shape on one thread
        (:func:`~linearize.timing.median_latency_ms`): a merged layer that is not faster is refused.
        """
        site = self.name if site is None else site
        record = MergeRecord(site, self.rule, what, float(flops[0]), float(flops[1]))
        shape = self.probe.in_shape.get(id(pieces[0]))
        if self.time_merges and shape is not None:
            p = next(pieces[0].parameters())
            x = torch.randn(1, *shape[1:], dtype=p.dtype, device=p.device)
            record.latency_ms_before, record.latency_ms_after = median_latency_ms(
                [nn.Sequential(*pieces), merged], x, budget_s=0.2, threads=1
            )
            record.kept = record.latency_ms_after < record.latency_ms_before
        self.summary.merges.append(record)
        timed = "" if record.latency_ms_before is None else (
            f", batch-1 latency {record.latency_ms_before:.4f} -> {record.latency_ms_after:.4f} ms"
        )
        if record.kept:
            self.merged(f"{what} (FLOPs {flops[0]:,.0f} -> {flops[1]:,.0f}{timed})", site)
        else:
            self.skipped(f"not merged into {what}: FLOPs {flops[0]:,.0f} -> {flops[1]:,.0f} but slower{timed}", site)
        return record.kept


class FoldRuleLike(Protocol):
    """Anything with a ``name``, ``matches(module, ctx) -> bool`` and ``apply(module, ctx) -> nn.Module | None``."""

    name: str

    def matches(self, module: nn.Module, ctx: FoldContext) -> bool: ...

    def apply(self, module: nn.Module, ctx: FoldContext) -> nn.Module | None: ...


@dataclass(frozen=True)
class FoldRule:
    """A fold rule from two functions.

    Args:
        name: unique name (reports, ``before=``).
        matches: ``(module, ctx) -> bool``: whether the rule applies to this module (cheap).
        apply: ``(module, ctx) -> nn.Module | None``: the replacement (or the module changed in
            place), or ``None`` to decline (report why with ``ctx.skipped(...)``).

    Example:
        >>> rule = FoldRule("double", matches=lambda m, ctx: False, apply=lambda m, ctx: None)
        >>> rule.name
        'double'
    """

    name: str
    matches: Callable[[nn.Module, FoldContext], bool]
    apply: Callable[[nn.Module, FoldContext], "nn.Module | None"]


def check_rule(rule: object) -> FoldRuleLike:
    """``rule`` if it is a usable fold rule, else a ``TypeError`` naming what is missing."""
    missing = []
    if not isinstance(getattr(rule, "name", None), str) or not rule.name:
        missing.append("name (a non-empty str)")
    for attr in ("matches", "apply"):
        if not callable(getattr(rule, attr, None)):
            missing.append(f"{attr} (a callable (module, ctx) -> {'bool' if attr == 'matches' else 'nn.Module | None'})")
    if missing:
        raise TypeError(
            f"{rule!r} is not a fold rule: it lacks {', '.join(missing)}; build one with "
            "linearize.FoldRule(name=..., matches=..., apply=...)"
        )
    return rule


def check_rules(rules: Iterable[object]) -> list[FoldRuleLike]:
    """A list of checked rules with unique names (``fold(..., rules=...)``)."""
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
        raise TypeError(f"rules must be a list of fold rules, got {type(rules).__name__}")
    out = [check_rule(r) for r in rules]
    names = [r.name for r in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"two fold rules are named {dup!r}: names must be unique")
    return out


_REGISTRY: list[FoldRuleLike] = []  # user rules first, then the built-in ones (filled by .builtin)
_BUILTIN: set[str] = set()
_BUILTIN_RULES: list[FoldRuleLike] = []


def _index(name: str) -> int:
    for i, r in enumerate(_REGISTRY):
        if r.name == name:
            return i
    raise ValueError(f"no fold rule named {name!r}; registered: {[r.name for r in _REGISTRY]}")


def register_fold_rule(rule: FoldRuleLike, *, before: str | None = None) -> FoldRuleLike:
    """Add ``rule`` to the rules every :func:`linearize.fold` call uses.

    Registered rules are asked before the built-in ones, in registration order; ``before`` names a
    rule (user or built-in) to insert ahead of instead. Returns ``rule``.

    Raises:
        TypeError: ``rule`` lacks ``name``, ``matches`` or ``apply``.
        ValueError: a rule of that name is registered already, or ``before`` names none.

    Example:
        >>> rule = FoldRule("noop", matches=lambda m, ctx: False, apply=lambda m, ctx: None)
        >>> _ = register_fold_rule(rule)
        >>> fold_rules()[0].name
        'noop'
        >>> unregister_fold_rule("noop")
    """
    rule = check_rule(rule)
    if any(r.name == rule.name for r in _REGISTRY):
        raise ValueError(f"a fold rule named {rule.name!r} is registered already: unregister_fold_rule it first")
    if before is not None:
        where = _index(before)
    else:
        where = next((i for i, r in enumerate(_REGISTRY) if r.name in _BUILTIN), len(_REGISTRY))
    _REGISTRY.insert(where, rule)
    return rule


def unregister_fold_rule(name: str) -> None:
    """Remove the registered rule ``name`` (built-in rules can be removed too; see :func:`fold_rules`)."""
    del _REGISTRY[_index(name)]


def fold_rules() -> list[FoldRuleLike]:
    """The rules :func:`linearize.fold` uses, in order (a copy: edit it and pass ``rules=``)."""
    return list(_REGISTRY)


def is_builtin(rule: FoldRuleLike) -> bool:
    """Whether ``rule`` is one of linearize's own rules (they report every change themselves)."""
    return any(r is rule for r in _BUILTIN_RULES)


def register_builtin(rules: Sequence[FoldRuleLike]) -> None:
    """Append the built-in rules (once, at import of :mod:`linearize.folding`)."""
    for rule in rules:
        _REGISTRY.append(check_rule(rule))
        _BUILTIN.add(rule.name)
        _BUILTIN_RULES.append(rule)

