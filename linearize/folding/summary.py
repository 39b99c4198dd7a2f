"""What :func:`linearize.fold` did: the :class:`FoldSummary` attached to the folded model."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MergeRecord:
    """One merge of several layers into one that the cost model chose (``FoldSummary.merges``).

    ``site``: the merged layers (``"b o a"``) or block; ``rule``: the fold rule that made it;
    ``result``: what they became; FLOPs over the whole ``example_inputs`` batch, before (the pieces,
    BatchNorm already folded) and after. With ``fold(..., merge_latency=True)`` the pieces and the
    merged layer were also timed at batch 1 on one thread (median ms; else ``None``), and ``kept`` is
    ``False`` where the merged layer was not faster, so fold left the pieces.
    """

    site: str
    rule: str
    result: str
    flops_before: float
    flops_after: float
    latency_ms_before: float | None = None
    latency_ms_after: float | None = None
    kept: bool = True

    def __str__(self) -> str:
        text = f"{self.site} [{self.rule}] -> {self.result}: FLOPs {self.flops_before:,.0f} -> {self.flops_after:,.0f}"
        if self.latency_ms_before is not None and self.latency_ms_after is not None:
            text += f", batch-1 latency {self.latency_ms_before:.4f} -> {self.latency_ms_after:.4f} ms"
        return text + ("" if self.kept else " (slower: not merged)")


@dataclass
class FoldSummary:
    """What :func:`fold` did, attached to the result as ``folded.linearize_fold_summary``.

    ``merged`` and ``skipped`` hold one line per decision (``"site: what (why)"``); ``merges`` one
    :class:`MergeRecord` per merge of layers (rule, FLOPs and latency before / after). FLOPs count
    2 per multiply-add of every linear, conv, matmul and attention op plus 2 per BatchNorm
    element, over the whole ``example_inputs`` batch (other element-wise ops not counted).
    Latencies are medians in milliseconds of interleaved repetitions on ``example_inputs``
    (``None`` with ``latency=False``). ``max_abs_error`` is the largest absolute difference
    between the outputs; ``output_scale`` the largest absolute reference output.

    ``verified_on`` is ``"output"``, or, when the output cannot tell a wrong fold from a right one
    (zero, or constant over samples that differ), ``"input of '<layer>'"``: that signal was
    verified too, with ``signal_error`` / ``signal_scale`` / ``signal_tolerance`` (``rtol`` times
    its scale), and the reason in ``verified_why``.
    """

    objective: str
    tol: float
    merged: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    merges: list[MergeRecord] = field(default_factory=list)
    units_before: int = 0
    units_left: int = 0
    params_before: int = 0
    params_after: int = 0
    flops_before: int = 0
    flops_after: int = 0
    latency_ms_before: float | None = None
    latency_ms_after: float | None = None
    max_abs_error: float = 0.0
    output_scale: float = 0.0
    tolerance: float = 0.0
    verify_dtype: str = ""
    verified_on: str = "output"
    verified_why: str = ""
    signal_error: float | None = None
    signal_scale: float | None = None
    signal_tolerance: float | None = None

    @property
    def flop_ratio(self) -> float:
        """FLOPs after / before."""
        return self.flops_after / max(self.flops_before, 1)

    @property
    def param_ratio(self) -> float:
        """Parameters after / before."""
        return self.params_after / max(self.params_before, 1)

    @property
    def latency_ratio(self) -> float | None:
        """Measured latency after / before (``None`` when latency was not measured)."""
        if self.latency_ms_before is None or self.latency_ms_after is None:
            return None
        return self.latency_ms_after / self.latency_ms_before

    def __str__(self) -> str:
        lines = [
            f"fold(objective={self.objective!r}, tol={self.tol}): "
            f"params {self.params_before:,} -> {self.params_after:,} ({self.param_ratio:.3f}x), "
            f"FLOPs {self.flops_before:,} -> {self.flops_after:,} ({self.flop_ratio:.3f}x)",
        ]
        if self.latency_ratio is not None:
            lines.append(
                f"latency {self.latency_ms_before:.3f} ms -> {self.latency_ms_after:.3f} ms "
                f"({self.latency_ratio:.3f}x, median of interleaved runs)"
            )
        lines.append(
            f"max abs error {self.max_abs_error:.3g} (output scale {self.output_scale:.3g}, "
            f"tolerance {self.tolerance:.3g}, {self.verify_dtype})"
        )
        if self.verified_on != "output":
            lines.append(
                f"verified on the {self.verified_on} ({self.verified_why}): max abs error "
                f"{self.signal_error:.3g} (scale {self.signal_scale:.3g}, tolerance {self.signal_tolerance:.3g})"
            )
        lines += [f"merge: {m}" for m in self.merges]
        lines += [f"merged: {m}" for m in self.merged] + [f"skipped: {s}" for s in self.skipped]
        return "\n".join(lines)
