"""Structured channel pruning of the sites linearize converts: the comparison a user would make, and a tool.

A *site* is a layer, the activation after it and the layer that takes the activation's channels:

- a transformer FFN (HF BERT's ``intermediate.dense -> act -> output.dense``, GPT-2's ``c_fc -> act ->
  c_proj``, a generic ``Linear -> act -> Linear``): the first layer loses output rows, the second input
  columns;
- a conv, its BatchNorm, the activation and the conv after it, inside a residual or inverted-residual block
  (``conv1 -> bn1 -> relu -> conv2``; MobileNet-V2's ``expand -> bn -> relu6 -> depthwise -> bn -> relu6 ->
  project``, where the depthwise conv couples two sites: they lose the same channels).

:func:`prune` keeps a number or fraction of each site's channels, ranked by an importance signal (or the
channels it is given by index: a pruned model rebuilt from its recorded indices), and returns the model
with the others removed: a real, smaller ``nn.Module`` with the same call signature.

How: the sites are found by running the example inputs with hooks (a dropout or identity between the
layers is followed; any other consumer of the channels, such as a residual add, a gate or a reshape,
makes it no site). Conv sites are cut through Torch-Pruning's dependency graph (``torch-pruning``, the
``prune`` extra), which also finds a conv's coupled layers (BatchNorm, depthwise convs) and refuses a
conv whose channels are the residual stream's. Dense (FFN) sites are sliced directly: their channels
reach nothing but the next layer (the hooks check it), so two slices are exact, and the FFNs of a whole
transformer then need no trace of its attention, masks and cache, which Torch-Pruning's graph needs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ._optional import require
from .activations import activation_kind
from .folding import count_flops
from .folding.layers import CONVS, is_hf_conv1d
from .inputs import Batches, call_model, eval_mode, float_outputs, hooks, inputs_fit, model_device, num_rows
from .unit import LinearizableActivation, units

__all__ = ["prune", "PruneSite", "PruneSummary", "IMPORTANCES"]

IMPORTANCES = ("magnitude", "taylor", "residual")
_PASSTHROUGH = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.Identity)
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
# tensor functions that read no values (a shape, a dtype): not a use of a site's channels
_METADATA = {"size", "dim", "__get__", "numel", "stride", "is_floating_point", "is_contiguous", "__len__",
             "ndimension", "data_ptr", "element_size", "get_device"}


@dataclass
class PruneSite:
    """One pruned site: the ``producer`` layer (its name is the site's), the BatchNorm after it (``norm``,
    or ``None``), the ``activation`` (module name), the ``consumer`` layer; ``channels`` before pruning,
    ``unit`` (the name ``linearize.convert`` gives the activation's unit at this call), ``kept`` (sorted
    indices of the channels kept), ``score`` (float64 ``[channels]``, the importance; for coupled sites, the
    sum over the group; ``None`` for indices given in ``keep``) and ``coupled`` (the other sites that lost the
    same channels)."""

    producer: str
    norm: str | None
    activation: str
    consumer: str
    channels: int
    unit: str
    kept: torch.Tensor | None = None
    score: torch.Tensor | None = None
    coupled: tuple[str, ...] = ()


@dataclass
class PruneSummary:
    """What :func:`prune` did: ``sites`` by name, parameters and FLOPs (:func:`linearize.count_flops` on the
    example inputs) before and after, and the ``importance`` used (``"indices"``: given in ``keep``)."""

    sites: dict[str, PruneSite]
    importance: str
    params_before: int
    params_after: int
    flops_before: int
    flops_after: int
    skipped: dict[str, str] = field(default_factory=dict)


@dataclass
class _Call:
    """A module call: its first argument and output, and their version counters when it ran (an in-place
    op between two calls, such as a residual ``out += x``, shows as a changed version)."""

    index: int
    name: str
    module: nn.Module
    input: torch.Tensor
    output: torch.Tensor
    in_version: int
    out_version: int


def _is_activation(m: nn.Module) -> bool:
    return isinstance(m, LinearizableActivation) or activation_kind(m) is not None


class _FreeUses(TorchFunctionMode):
    """Records the tensors that torch functions take outside the hooked modules (``depth == 0``): a
    functional use of a site's channels (``h * x``, a reshape) that no module hook sees. A function that
    hands back its first argument unchanged (the same tensor, not written to: an eval-mode ``F.dropout``,
    as in Marian's and BART's FFNs) is no use."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.uses: list[tuple[str, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        version = first._version if first is not None else None
        out = func(*args, **kwargs)
        if self.depth == 0 and name not in _METADATA and not (out is first and first._version == version):
            for a in [*args, *kwargs.values()]:
                for t in (a if isinstance(a, (list, tuple)) else [a]):
                    if isinstance(t, torch.Tensor):
                        self.uses.append((name, t))
        return out


def _trace(model: nn.Module, example_inputs: Any) -> tuple[list[_Call], list[tuple[str, torch.Tensor]]]:
    """Every call of a leaf module or activation on ``example_inputs`` whose first argument and output are
    tensors, in order, and the tensors torch functions outside those calls took (:class:`_FreeUses`); the
    tensors are held, so ``is`` identifies them."""
    calls: list[_Call] = []
    versions: list[int] = []  # of the first argument, before each call that is running
    free = _FreeUses()

    def before(mod, args):
        free.depth += 1
        versions.append(args[0]._version if args and isinstance(args[0], torch.Tensor) else -1)

    def hook(name: str):
        def record(mod, args, out):
            free.depth -= 1
            version = versions.pop()
            if args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
                calls.append(_Call(len(calls), name, mod, args[0], out, version, out._version))
        return record

    with hooks() as handles, eval_mode(model), torch.no_grad():
        for name, m in model.named_modules():
            if name and (not any(True for _ in m.children()) or _is_activation(m)):
                handles.append(m.register_forward_pre_hook(before))
                handles.append(m.register_forward_hook(hook(name)))
        with free, inputs_fit(example_inputs):
            call_model(model, example_inputs)
    return calls, free.uses


def _layer_channels(m: nn.Module, side: str) -> int | None:
    """Output (``side="out"``) or input channels of a dense / conv layer, else ``None``."""
    if is_hf_conv1d(m):
        return m.weight.shape[1] if side == "out" else m.weight.shape[0]
    if type(m) is nn.Linear:
        return m.out_features if side == "out" else m.in_features
    if isinstance(m, CONVS):
        return m.out_channels if side == "out" else m.in_channels
    return None


def _find_sites(calls: list[_Call], free: list[tuple[str, torch.Tensor]]
                ) -> tuple[dict[str, PruneSite], dict[str, nn.Module], dict[str, str]]:
    """``(sites, modules by name, why each other layer before an activation is no site)`` from
    :func:`_trace`'s calls and free uses."""
    modules = {c.name: c.module for c in calls}
    sites: dict[str, PruneSite] = {}
    skipped: dict[str, str] = {}

    def producer_of(call: _Call) -> _Call | None:
        """The call whose output is ``call``'s input, unchanged in between (else ``None``)."""
        src = next((c for c in reversed(calls[:call.index]) if c.output is call.input), None)
        return src if src is not None and src.out_version == call.in_version else None

    def consumers_of(src: _Call) -> list[_Call]:
        return [c for c in calls[src.index + 1:] if c.input is src.output]

    for act in calls:
        if not _is_activation(act.module):
            continue
        chain, norm, src = [act], None, producer_of(act)
        while src is not None and (isinstance(src.module, _PASSTHROUGH) or (norm is None and isinstance(src.module, _NORMS))):
            norm = src if isinstance(src.module, _NORMS) else norm
            chain.append(src)
            src = producer_of(src)
        if src is None or _layer_channels(src.module, "out") is None or src.name in sites:
            continue
        channels = _layer_channels(src.module, "out")
        # forward from the activation through dropouts / identities
        ends, frontier = [], [act]
        for _ in range(len(calls)):  # bounded: each step moves to later calls
            if not frontier:
                break
            step = frontier.pop()
            for c in consumers_of(step):
                if any(c is seen for seen in [*chain, *ends]):  # an eval-mode dropout returns its input
                    continue
                if isinstance(c.module, _PASSTHROUGH):
                    chain.append(c)
                    frontier.append(c)
                else:
                    ends.append(c)
        outside = [f"{c.name} ({type(c.module).__name__})" for link in [src, *chain] for c in consumers_of(link)
                   if all(c is not seen for seen in [src, *chain, *ends])]
        outside += [f"torch function {op}" for op, t in free if any(t is link.output for link in [src, *chain])]
        layers = [e for e in ends if _layer_channels(e.module, "in") == channels]
        if not ends:
            skipped[src.name] = (f"{type(src.module).__name__} -> {type(act.module).__name__} ({act.name}) has no "
                                 "following layer: the activation's output goes to no Linear / conv module")
        elif len(ends) > 1 or len(layers) != 1 or outside:
            what = ", ".join([*(f"{c.name} ({type(c.module).__name__})" for c in ends), *outside])
            skipped[src.name] = (f"the channels of {type(src.module).__name__} -> {type(act.module).__name__} "
                                 f"({act.name}) reach {what}, not exactly one following layer taking all "
                                 f"{channels} of them")
        else:
            consumer = layers[0]
            if isinstance(src.module, CONVS) != isinstance(consumer.module, CONVS):
                skipped[src.name] = (f"{src.name} ({type(src.module).__name__}) feeds {consumer.name} "
                                     f"({type(consumer.module).__name__}): a conv and a dense layer")
                continue
            sites[src.name] = PruneSite(src.name, norm.name if norm else None, act.name, consumer.name, channels,
                                        _unit_name(calls, act))
    return sites, modules, skipped


# ----------------------------------------------------------------------------- importance


def _rows_sq(m: nn.Module, side: str) -> torch.Tensor:
    """Squared norm ``[C]`` of each output channel's (``side="out"``) or input channel's weights."""
    w = m.weight.detach().double()
    if is_hf_conv1d(m):  # [in, out]
        return (w * w).sum(0) if side == "out" else (w * w).sum(1)
    if type(m) is nn.Linear:
        return (w * w).sum(1) if side == "out" else (w * w).sum(0)
    per = (w * w).flatten(2).sum(2)  # conv: [out, in / groups]
    if side == "out":
        return per.sum(1)
    groups, out_per_group = m.groups, m.out_channels // m.groups
    return torch.cat([per[g * out_per_group:(g + 1) * out_per_group].sum(0) for g in range(groups)])


def _magnitude(sites: dict[str, PruneSite], modules: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    return {n: (_rows_sq(modules[s.producer], "out") + _rows_sq(modules[s.consumer], "in")).sqrt()
            for n, s in sites.items()}


def _energy_loss(out: Any) -> torch.Tensor:
    return sum(0.5 * (t.float() ** 2).sum() for t in float_outputs(out))


def _taylor(model: nn.Module, sites: dict[str, PruneSite], modules: dict[str, nn.Module], data: Any,
            loss: Callable[[Any], torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Per site, ``sum |x * dL/dx|`` over the calibration data of each channel of the consumer's input."""
    loss = loss or _energy_loss
    scores = {n: torch.zeros(s.channels, dtype=torch.float64) for n, s in sites.items()}
    seen: list[tuple[str, torch.Tensor]] = []

    def pre(name: str, conv: bool):
        def hook(mod, args):
            x = args[0]
            if x.shape[1 if conv else -1] == sites[name].channels and x.requires_grad:
                seen.append((name, x))
        return hook

    params = [p for p in model.parameters() if not p.requires_grad]
    with hooks() as handles, eval_mode(model), torch.enable_grad():
        for p in params:
            p.requires_grad_(True)  # the consumers' inputs need a graph; restored below
        try:
            for name, s in sites.items():
                consumer = modules[s.consumer]
                handles.append(consumer.register_forward_pre_hook(pre(name, isinstance(consumer, CONVS))))
            for index, inputs in enumerate(Batches.of(data).to(model_device(model))):
                if not num_rows(inputs):
                    continue
                seen.clear()
                mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
                value = loss(call_model(model, inputs))
                if not isinstance(value, torch.Tensor) or value.numel() != 1:
                    raise ValueError(f"prune(importance='taylor'): loss must return a scalar tensor, got "
                                     f"{type(value).__name__}{tuple(getattr(value, 'shape', ()))}")
                grads = torch.autograd.grad(value, [x for _, x in seen], allow_unused=True)
                for (name, x), g in zip(seen, grads):
                    if g is None:
                        continue
                    conv = isinstance(modules[sites[name].consumer], CONVS)
                    x, g = x.detach().double(), g.double()  # a float16 product of finite factors can overflow
                    if mask is not None and not conv and x.ndim == 3 and tuple(x.shape[:2]) == tuple(mask.shape):
                        kept = mask.to(x.device).bool().unsqueeze(-1)  # padding is no data
                        x, g = torch.where(kept, x, 0.0), torch.where(kept, g, 0.0)
                    prod = (x * g).abs()
                    batch = (prod.movedim(1, -1) if conv else prod).reshape(-1, prod.shape[1 if conv else -1]).sum(0)
                    if not bool(torch.isfinite(batch).all()):
                        raise ValueError(_taylor_nonfinite(name, index, bool(torch.isfinite(x).all())))
                    scores[name] += batch.cpu()
        finally:
            for p in params:
                p.requires_grad_(False)
    return scores


def _taylor_nonfinite(site: str, batch: int, input_finite: bool) -> str:
    """The error of a Taylor score that is NaN/inf: the input of ``site``'s consumer on ``batch`` of data holds
    NaN/inf (the data, or the model's activations on it), or else the loss gradient at it does."""
    where = (f"the loss gradient at site {site!r} holds NaN/inf on batch {batch} of data while the site's values "
             "are finite (the loss is not finite there, or the backward pass overflowed in the model's dtype)"
             if input_finite else f"the values at site {site!r} hold NaN/inf on batch {batch} of data (the data, "
             "or the model's activations on it)")
    fix = ("Fix: give a loss that is finite on that batch, or score a float32 copy of the model (model.float())"
           if input_finite else "Fix: drop or repair those samples")
    return (f"prune(importance='taylor'): {where}, so the scores |x * dL/dx| of its channels are not finite and "
            f"would rank them at random. {fix} (or use importance='magnitude')")


def _unit_name(calls: list[_Call], act: _Call) -> str:
    """The name ``linearize.convert`` gives the unit of an activation call: the module's name, or
    ``name.calls.k`` for its ``k``-th call (from 0) of several."""
    mine = [c for c in calls if c.module is act.module]
    return act.name if len(mine) == 1 else f"{act.name}.calls.{[c.index for c in mine].index(act.index)}"


def _residual(model: nn.Module, sites: dict[str, PruneSite], data: Any,
              example_inputs: Any) -> dict[str, torch.Tensor]:
    """:func:`linearize.one_shot`'s score (the affine end's residual times the outgoing weight norm) of
    each site's channels, computed on a converted copy of the model."""
    from .calibration import one_shot
    from .conversion import convert

    converted = convert(copy.deepcopy(model), example_inputs=example_inputs)
    names = {n: s.unit for n, s in sites.items()}
    present = {u for u, _ in units(converted)}
    missing = sorted(n for n, u in names.items() if u not in present)
    if missing:
        raise ValueError(f"prune(importance='residual'): the activations of sites {missing[:3]} are called more "
                         "than once, so their converted units hold several sites; use importance='magnitude' or "
                         "'taylor' for them, or prune them in a separate call")
    scored = one_shot(converted, data, target=1.0, units=list(dict.fromkeys(names.values())), freeze=False)
    return {n: scored[names[n]].score.clone() for n in sites}


# ----------------------------------------------------------------------------- surgery


def _slice_dense(modules: dict[str, nn.Module], site: PruneSite, keep: torch.Tensor) -> None:
    """Keep the ``keep`` channels of a dense site: rows of the producer (and its BatchNorm), columns of the
    consumer."""
    prod, cons = modules[site.producer], modules[site.consumer]
    with torch.no_grad():
        if is_hf_conv1d(prod):
            prod.weight = nn.Parameter(prod.weight[:, keep].clone(), prod.weight.requires_grad)
            prod.nf = len(keep)
        else:
            prod.weight = nn.Parameter(prod.weight[keep].clone(), prod.weight.requires_grad)
            prod.out_features = len(keep)
        if prod.bias is not None:
            prod.bias = nn.Parameter(prod.bias[keep].clone(), prod.bias.requires_grad)
        if site.norm is not None:
            bn = modules[site.norm]
            for attr in ("weight", "bias"):
                if getattr(bn, attr, None) is not None:
                    setattr(bn, attr, nn.Parameter(getattr(bn, attr)[keep].clone(), getattr(bn, attr).requires_grad))
            for attr in ("running_mean", "running_var"):
                if getattr(bn, attr, None) is not None:
                    setattr(bn, attr, getattr(bn, attr)[keep].clone())
            bn.num_features = len(keep)
        if is_hf_conv1d(cons):
            cons.weight = nn.Parameter(cons.weight[keep].clone(), cons.weight.requires_grad)
        else:
            cons.weight = nn.Parameter(cons.weight[:, keep].clone(), cons.weight.requires_grad)
            cons.in_features = len(keep)


def _conv_groups(tp: Any, graph: Any, sites: dict[str, PruneSite], modules: dict[str, nn.Module],
                 skipped: dict[str, str]) -> list[list[str]]:
    """Conv sites in groups that must lose the same channels (coupled by depthwise convs); a site whose
    channels Torch-Pruning couples to any other conv's outputs (a residual stream) moves to ``skipped``."""
    producers = {id(modules[s.producer]): n for n, s in sites.items() if isinstance(modules[s.producer], CONVS)}
    groups: list[list[str]] = []
    member: dict[str, int] = {}
    for name in [n for n in sites if isinstance(modules[sites[n].producer], CONVS)]:
        group = graph.get_pruning_group(modules[name], tp.prune_conv_out_channels, idxs=[0])
        outs = [dep.target.module for dep, _ in group
                if isinstance(dep.target.module, (*CONVS, nn.Linear)) and "out_channels" in _handler(dep)]
        others = [m for m in outs if m is not modules[name] and id(m) not in producers
                  and not (isinstance(m, CONVS) and m.groups == m.in_channels == m.out_channels)]
        if others:
            skipped[name] = ("its channels are coupled to other layers' outputs (a residual stream, or a site "
                             f"coupled through a depthwise conv left out of sites=): "
                             f"{', '.join(type(m).__name__ for m in others[:3])}")
            continue
        linked = [producers[id(m)] for m in outs if id(m) in producers]
        index = next((member[n] for n in linked if n in member), None)
        if index is None:
            index = len(groups)
            groups.append([])
        for n in [name, *linked]:
            if n not in member:
                member[n] = index
                groups[index].append(n)
    for n in [n for g in groups for n in g if n in skipped]:  # a coupled site of a refused one
        skipped.setdefault(groups[member[n]][0], skipped[n])
    return [g for g in groups if not any(n in skipped for n in g)]


def _handler(dep: Any) -> str:
    return getattr(dep.handler, "__name__", repr(dep.handler))


def _keep_count(keep: int | float, site: str, channels: int) -> int:
    if isinstance(keep, bool) or not isinstance(keep, (int, float)):
        raise TypeError(f"keep must be a number of channels (int) or a fraction (float in (0, 1]), got {keep!r}")
    if isinstance(keep, float):
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"keep={keep!r}: a fraction must be in (0, 1] (keep=0 would remove every channel of "
                             "each site, cutting the network); pass a positive int for a number of channels")
        return max(1, round(keep * channels))
    if keep < 1:
        raise ValueError(f"keep={keep!r}: keep at least 1 channel per site (removing every channel of a site cuts "
                         "the network); to keep a fraction, pass a float in (0, 1]")
    if keep > channels:
        raise ValueError(f"keep={keep} channels, but site {site!r} has only {channels}: pass keep <= {channels} "
                         "or a fraction (float)")
    return keep


def _given_indices(name: str, value: Any, channels: int) -> torch.Tensor:
    """The channel indices ``value`` that ``keep={name: value}`` keeps of site ``name`` (``channels`` wide),
    checked: integers, at least one, none twice, each in ``[0, channels)``; sorted."""
    form = f"keep[{name!r}]: give a non-empty list of channel indices (ints), got {value!r:.80}"
    if isinstance(value, (str, bytes, Mapping)):
        raise ValueError(form)
    try:
        t = value.detach().cpu() if isinstance(value, torch.Tensor) else torch.as_tensor(value, device="cpu")
    except (TypeError, ValueError, RuntimeError) as e:  # strings in a list, ragged nesting, objects
        raise ValueError(form) from e
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex() or t.ndim != 1 or not len(t):
        raise ValueError(form)
    t = t.long()
    bad = t[(t < 0) | (t >= channels)]
    if len(bad):
        raise ValueError(f"keep[{name!r}]: index {int(bad[0])} is not a channel of the site (it has {channels}: "
                         f"0 to {channels - 1})")
    if len(t.unique()) != len(t):
        raise ValueError(f"keep[{name!r}]: indices repeat (each channel is kept once): give each index once")
    return t.sort().values


def prune(
    model: nn.Module,
    keep: int | float | Mapping[str, Any],
    importance: str = "magnitude",
    data: Any = None,
    example_inputs: Any = None,
    sites: list[str] | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
) -> nn.Module:
    """Remove the least important channels of each site (see the module docstring), in place.

    Each site keeps ``keep`` channels (an int) or ``round(keep * C)`` of its ``C`` (a float in ``(0, 1]``,
    at least one), ranked by ``importance``, or the channels ``keep[site]`` names (a mapping ``{site name:
    kept channel indices}``, as :attr:`PruneSite.kept` records them: the sites pruned are its keys, importance
    is not used, and sites coupled by a depthwise conv must be given the same indices), so a pruned model can
    be rebuilt from its builder, the recorded indices and its state dict. Importances:

    - ``"magnitude"``: the L2 norm of the channel's weights in and out (its producer row and consumer
      column);
    - ``"taylor"``: ``sum |x * dL/dx|`` over ``data`` of the channel's input ``x`` to the consumer (padding
      excluded, as in :mod:`linearize.calibration`), ``L = loss(model output)``; default ``loss``: half the
      sum of squares of the model's float outputs. The model runs in eval mode; no ``.grad`` is touched; a batch
      that gives a channel a NaN/inf score (NaN/inf in the data, or an overflow) raises ``ValueError`` naming it;
    - ``"residual"``: :func:`linearize.one_shot`'s score on ``data`` (the residual of the channel's affine
      fit times its outgoing weight norm: the error of replacing it by a linear end), from a converted copy.
      It ranks channels by how nonlinear they are, which is the right choice for linearizing; for removing
      them, magnitude or Taylor measure what is lost.

    Sites coupled by a depthwise conv (MobileNet-V2) are ranked by the sum of their scores and lose the same
    channels. Kept channels stay in their order.

    Args:
        model: a plain (unconverted) model; changed in place. A converted one (with linearize units) is refused.
        keep: channels kept per site: an int ``>= 1``, a fraction in ``(0, 1]``, or ``{site: indices}``.
        importance: ``"magnitude"``, ``"taylor"`` or ``"residual"``.
        data: calibration data for ``"taylor"`` and ``"residual"`` (the forms of :mod:`linearize.inputs`).
        example_inputs: one batch to find the sites on and count FLOPs (default: the first batch of ``data``).
        sites: names of the sites (their first layer's qualified name) to prune (default: every site found).
        loss: ``loss(output) -> scalar`` for ``"taylor"``.

    Returns: ``model``, smaller, with ``model.linearize_prune_summary`` (:class:`PruneSummary`).

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 2))
        >>> small = linearize.prune(net, keep=4, example_inputs=torch.randn(2, 4))
        >>> small[0].out_features, small[2].in_features, small(torch.randn(3, 4)).shape
        (4, 4, torch.Size([3, 2]))
    """
    if importance not in IMPORTANCES:
        raise ValueError(f"importance must be one of {IMPORTANCES}, got {importance!r}")
    converted = [n for n, _ in units(model)]
    if converted:
        raise ValueError(f"prune takes a plain model; this one was converted by linearize.convert (it holds units "
                         f"{converted[:3]}{' ...' if len(converted) > 3 else ''}). Fix: prune a copy of the model made "
                         "before convert (copy.deepcopy(model) first), or convert the pruned model")
    given = keep if isinstance(keep, Mapping) else None
    if given is not None:
        if sites is not None:
            raise ValueError("prune: keep={site: indices} names the sites to prune; drop sites= (or pass only "
                             "those sites in keep)")
        if not given:
            raise ValueError("prune: keep={} names no site: give {site name: kept channel indices}")
        sites = list(given)
    elif importance in ("taylor", "residual") and data is None:
        raise ValueError(f"prune(importance={importance!r}) needs calibration data: pass data=<batches>")
    if example_inputs is None:
        if data is None:
            raise ValueError("prune needs example_inputs (one batch to find the sites on) or data")
        example_inputs = next(iter(Batches.of(data)))
    found, modules, skipped = _find_sites(*_trace(model, example_inputs))
    if sites is not None:
        wanted = list(dict.fromkeys(sites))
        for n in wanted:
            if n in skipped:
                raise ValueError(f"prune: site {n!r} cannot be pruned: {skipped[n]}. Fix: leave it out of sites=")
            if n not in found:
                raise ValueError(f"prune: no site named {n!r}; the sites (a layer before an activation and the layer "
                                 f"after it) are {list(found)[:6]}{' ...' if len(found) > 6 else ''}")
        found = {n: found[n] for n in wanted}
    conv_groups: list[list[str]] = []
    graph = tp = None
    if any(isinstance(modules[s.producer], CONVS) for s in found.values()):
        tp = require("torch_pruning", what="linearize.prune on conv sites")
        graph = tp.DependencyGraph().build_dependency(model, example_inputs=example_inputs)
        conv_groups = _conv_groups(tp, graph, found, modules, skipped)
        if sites is not None:
            refused = [n for n in found if n in skipped]
            if refused:
                raise ValueError(f"prune: site {refused[0]!r} cannot be pruned: {skipped[refused[0]]}. "
                                 "Fix: leave it out of sites=")
        found = {n: s for n, s in found.items() if n not in skipped}
    if not found:
        why = "; ".join(f"{n}: {w}" for n, w in list(skipped.items())[:3])
        raise ValueError("prune: the model has no prunable site (a Linear / conv, an activation, and one Linear / "
                         f"conv taking all its channels){': ' + why if why else ''}")
    groups = conv_groups + [[n] for n, s in found.items() if not isinstance(modules[s.producer], CONVS)]
    if given is not None:
        indices = {n: _given_indices(n, given[n], s.channels) for n, s in found.items()}
        for group in groups:
            differ = [n for n in group[1:] if not torch.equal(indices[n], indices[group[0]])]
            if differ:
                raise ValueError(f"prune: sites {group[0]!r} and {differ[0]!r} are coupled (a depthwise conv "
                                 "between them): they lose the same channels, so give them the same indices")
        chosen = {g[0]: (indices[g[0]], None) for g in groups}  # (kept, score) per group
        importance = "indices"
    else:
        counts = {g[0]: _keep_count(keep, g[0], found[g[0]].channels) for g in groups}
        if importance == "magnitude":
            scores = _magnitude(found, modules)
        elif importance == "taylor":
            scores = _taylor(model, found, modules, data, loss)
        else:
            scores = _residual(model, found, data, example_inputs)
        chosen = {}
        for group in groups:
            score = sum(scores[n] for n in group)
            order = torch.sort(score, descending=True, stable=True).indices
            chosen[group[0]] = (order[:counts[group[0]]].sort().values, score)
    params_before = sum(p.numel() for p in model.parameters())
    flops_before = count_flops(model, example_inputs)
    for group in groups:
        kept, score = chosen[group[0]]
        for n in group:
            found[n].kept, found[n].score, found[n].coupled = kept, score, tuple(m for m in group if m != n)
        head = modules[group[0]]
        if isinstance(head, CONVS):
            removed = sorted(set(range(found[group[0]].channels)) - set(kept.tolist()))
            if removed:
                graph.get_pruning_group(head, tp.prune_conv_out_channels, idxs=removed).prune()
        else:
            _slice_dense(modules, found[group[0]], kept.to(head.weight.device))
    summary = PruneSummary(found, importance, params_before, sum(p.numel() for p in model.parameters()),
                           flops_before, count_flops(model, example_inputs), skipped)
    model.linearize_prune_summary = summary
    return model
