"""Argument validators and the errors they raise, shared by the whole package.

The lowest layer of ``linearize`` (it imports nothing from the package): every public function
that takes a tolerance, a positive size or a module pattern checks it here, so the accepted
ranges and the messages are the same everywhere. The validators return the checked value
(as a plain ``float`` / ``int`` / ``list``) so callers can write ``tol = check_tol(tol)``.
"""

from __future__ import annotations

import argparse
import math
import numbers
import re
from typing import Callable, Iterable

__all__ = [
    "NonFiniteSlopeError",
    "FoldVerificationError",
    "check_tol",
    "check_positive",
    "check_positive_int",
    "check_channel_dim",
    "as_patterns",
    "arg_type",
    "check_fraction",
]


class NonFiniteSlopeError(ValueError):
    """A unit slope is NaN or infinite (training diverged): it is neither linear nor nonlinear."""


class FoldVerificationError(RuntimeError):
    """A folded or compressed model does not compute the original function within the tolerance."""


TOL_MEANING = "a channel counts as linear when its slope a >= 1 - tol"


def is_real(value: object) -> bool:
    """A real number (int, float, numpy scalar), not a bool or a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def finite_nonnegative(values: object, length: int) -> bool:
    """``values`` is a list of ``length`` finite real numbers ``>= 0`` (as read back from JSON state)."""
    return (isinstance(values, list) and len(values) == length
            and all(is_real(v) and math.isfinite(v) and v >= 0 for v in values))


def _real(value: object, name: str) -> float:
    if not is_real(value):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def check_tol(tol: object, upper: float = 1.0, name: str = "tol") -> float:
    """``tol`` as a float in ``[0, upper)``, else ``ValueError`` / ``TypeError``.

    ``tol`` is how far below 1 a slope may be and still count as linear (``a >= 1 - tol``):
    ``0`` counts exactly linear channels only, and ``tol >= 1`` would call every channel
    (``a >= 0``) linear, so the range is ``[0, 1)``. :func:`linearize.freeze` asks for
    ``upper=0.5``: it also snaps ``a <= tol`` to 0, and no channel may be both.
    """
    value = _real(tol, name)
    if not 0.0 <= value < upper:
        raise ValueError(f"{name} must lie in [0, {upper:g}) ({TOL_MEANING}), got {tol!r}")
    return value


def check_positive(value: object, name: str) -> float:
    """``value`` as a finite float ``> 0`` (tolerances such as ``rtol``/``atol``, learning rates)."""
    value = _real(value, name)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def check_fraction(value: object, name: str) -> float:
    """``value`` as a float in ``(0, 1]`` (a share of channels, a cost ratio)."""
    value = _real(value, name)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must lie in (0, 1], got {value}")
    return value


def check_positive_int(value: object, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an int ``>= minimum`` and, when given, ``<= maximum`` (batch sizes, sample counts)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        within = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ValueError(f"{name} must be an int {within}, got {value}")
    return int(value)


def check_channel_dim(channel_dim: object, ndim: int | None = None, where: str = "") -> int:
    """``channel_dim`` checked (and, with ``ndim``, normalized to ``[1, ndim)``) for an input of ``ndim`` dims.

    Dim 0 is the batch dimension: slopes along it would be one per *sample*, not per channel, so
    it is refused (also without ``ndim``; a 1-dim input has only its channel dim).
    """
    at = f" at {where}" if where else ""
    fix = "use 1 for [N, C, ...] feature maps or -1 for [..., C] features"
    if isinstance(channel_dim, bool) or not isinstance(channel_dim, numbers.Integral):
        raise TypeError(f"channel_dim must be an int, got {channel_dim!r}")
    channel_dim = int(channel_dim)
    if ndim is not None and not -ndim <= channel_dim < ndim:
        raise ValueError(f"channel_dim={channel_dim} is out of range for the {ndim}-dim input{at}: {fix}")
    if channel_dim == 0 or (ndim is not None and ndim >= 2 and channel_dim % ndim == 0):
        raise ValueError(
            f"channel_dim={channel_dim} is the batch dimension{at}: every sample would get its own "
            f"slope; {fix}"
        )
    return channel_dim % ndim if ndim is not None else channel_dim


def as_patterns(patterns: object, name: str) -> list[str] | None:
    """Module-name patterns as a list: one string is one pattern (not its characters).

    Each pattern is matched by ``re.fullmatch`` or as a dotted suffix of the qualified name; an
    invalid regular expression raises ``ValueError`` naming it.
    """
    if patterns is None:
        return None
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, Iterable) or isinstance(patterns, (bytes, dict)):
        raise TypeError(f"{name} must be a string or a list of strings, got {patterns!r}")
    patterns = list(patterns)
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise TypeError(f"{name} must hold non-empty strings (module-name patterns), got {p!r}")
        try:
            re.compile(p)
        except re.error as err:
            raise ValueError(f"{name} pattern {p!r} is not a valid regular expression ({err})") from None
    return patterns


def arg_type(check: Callable[..., object], *args: object) -> Callable[[str], object]:
    """An ``argparse`` ``type=`` that parses a number and runs ``check(value, *args)`` on it.

    ``arg_type(check_positive_int, "--batch-size")`` turns ``--batch-size 0`` into an argparse
    usage error instead of a traceback deep inside the run.
    """
    integral = check is check_positive_int

    def parse(text: str) -> object:
        value = int(text) if integral else float(text)  # a ValueError here: argparse's "invalid int value"
        try:
            return check(value, *args)
        except (TypeError, ValueError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = "int" if integral else "float"  # argparse names the type in its "invalid" message
    return parse
