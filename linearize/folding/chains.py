"""The ``nn.Sequential`` rule: in every plain ``nn.Sequential`` (nested ones flattened) move the affine
linear ends of units into the layer before them (:func:`.layers.absorb_linear_end`), drop units
whose channels are all linear, fold BatchNorm (eval statistics) into the layer before it, merge runs
of adjacent linear maps (``Linear o Linear``, ``Conv o Conv``, grouped and depthwise convs, 1x1 convs
into neighbours) where exact and better under the objective (a small dynamic program over each run),
and split ``Linear|Conv1x1 -> unit -> Linear|Conv1x1`` FFNs (:func:`.ffn.split_ffn`)."""

from __future__ import annotations

import math
from typing import Iterator

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..unit import LinearizableActivation
from .conv import border_flops, ConvDesc, chain_plan, merge_convs, needs_border_correction
from .ffn import is_transparent, split_in_chain
from .layers import CONVS, absorb_linear_end, bn_foldable, dense_shape, dense_wb, fold_bn, is_dense, is_plain_conv, make_linear
from .rules import Cost, FoldContext

Item = tuple[str, nn.Module]


def is_plain_sequential(m: nn.Module) -> bool:
    """An ``nn.Sequential`` (or subclass) that keeps ``nn.Sequential``'s forward."""
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward


def flatten_sequential(seq: nn.Sequential, prefix: str) -> Iterator[Item]:
    """``(qualified name, module)`` of ``seq``'s layers, nested plain Sequentials flattened."""
    for child_name, m in seq.named_children():
        full = f"{prefix}.{child_name}" if prefix else child_name
        if is_plain_sequential(m):
            yield from flatten_sequential(m, full)
        else:
            yield full, m


def chain_layers(m: nn.Module) -> list[nn.Module]:
    """``m``'s layers in call order: a plain Sequential's flattened, else ``[m]``."""
    return [layer for _, layer in flatten_sequential(m, "")] if is_plain_sequential(m) else [m]


def fold_chain(seq: nn.Sequential, ctx: FoldContext) -> nn.Module | None:
    """The ``sequential`` rule: :func:`fold_sequential` for a Sequential that ran as a chain. One whose
    layers a forward other than its own calls by name (timm MetaFormer's ``self.head.fc(...)``), or
    holds such a Sequential, or that did not run, is left as is (``None``): that forward decides what
    runs, so removing or merging one of its layers could change the model's function or break a name
    it reads. ``probe.chains`` records the Sequentials that passed (children are visited first)."""
    for name, child in seq.named_children():
        if ctx.probe.callers.get(id(child), set()) - {id(seq)}:
            why = "is called by name from outside the nn.Sequential's forward"
        elif is_plain_sequential(child) and id(child) not in ctx.probe.chains:
            why = "is a nested nn.Sequential left as is"
        else:
            continue
        ctx.skipped(f"{ctx.site(name)} {why}; the Sequential is left as is (folding it could change what runs)")
        return None
    if not ctx.probe.calls.get(id(seq)):
        ctx.skipped("nn.Sequential did not run on example_inputs; left as is")
        return None
    new = fold_sequential(seq, ctx)
    ctx.probe.chains.update((id(seq), id(new)))
    return new


def _nest(kept: list[Item], prefix: str) -> nn.Sequential:
    """A new ``nn.Sequential`` holding ``kept`` under their own names: ``kept``'s paths (under
    ``prefix``, the folded Sequential's) rebuild the nested Sequentials they came from."""
    root = nn.Sequential()
    for path, m in kept:
        *outer, leaf = (path[len(prefix) + 1:] if prefix else path).split(".")
        seq = root
        for name in outer:
            if name not in seq._modules:
                seq.add_module(name, nn.Sequential())
            seq = seq._modules[name]
        seq.add_module(leaf, m)
    return root


def fold_sequential(seq: nn.Sequential, ctx: FoldContext) -> nn.Module:
    """The folded chain (a new ``nn.Sequential``), or ``seq`` itself when nothing changed. Layers kept
    keep their names (and nesting); a merged layer takes its first layer's name."""
    items = list(flatten_sequential(seq, ctx.name))
    if not items:
        return seq
    changed = False
    kept: list[Item] = []
    for n, m in items:
        if isinstance(m, LinearizableActivation) and kept and ctx.once(m) and ctx.once(kept[-1][1]):
            shape = ctx.probe.out_shape.get(id(kept[-1][1]), ())
            axis = 1 if isinstance(kept[-1][1], CONVS) else len(shape) - 1
            moved = absorb_linear_end(kept[-1][1], m, bool(shape) and m.channel_dim % len(shape) == axis, ctx.tol)
            if moved:
                ctx.merged(f"affine linear ends of {moved} channel(s) folded into {kept[-1][0]}", n)
                changed = True
        if ctx.is_linear(m) and ctx.once(m) or type(m) is nn.Identity:
            if isinstance(m, LinearizableActivation):
                ctx.merged("fully linear unit removed (identity)", n)
            changed = True
            continue
        if isinstance(m, _BatchNorm) and kept:
            prev_name, prev = kept[-1]
            reason = bn_foldable(prev, m)
            if reason is None and not (ctx.once(prev) and ctx.once(m)):
                reason = "layer called more than once"
            if reason is None and type(prev) is nn.Linear and len(ctx.probe.out_shape[id(prev)]) != 2:
                reason = "BatchNorm1d over a sequence normalizes a different dim than Linear"
            if reason is None:
                fold_bn(prev, m)
                ctx.merged(f"BatchNorm folded into {prev_name}", n)
                changed = True
                continue
            ctx.skipped(f"BatchNorm kept ({reason})", n)
        kept.append((n, m))
    kept, merged_any = _merge_runs(kept, ctx)
    split_any = split_in_chain(kept, ctx)
    if not (changed or merged_any or split_any):
        return seq
    return _nest(kept, ctx.name)


def is_map(m: nn.Module, ctx: FoldContext) -> bool:
    """A plain conv or dense layer that ran once: one fold may merge with its neighbours."""
    return (is_plain_conv(m) or is_dense(m)) and ctx.once(m)


def _same_family(a: nn.Module, b: nn.Module) -> bool:
    if is_dense(a) and is_dense(b):
        return True
    return is_plain_conv(a) and is_plain_conv(b) and type(a) is type(b)


def _merge_runs(items: list[Item], ctx: FoldContext) -> tuple[list[Item], bool]:
    """Merge runs of adjacent linear maps (eval Dropout between them is transparent)."""
    out: list[Item] = []
    changed = False
    i = 0
    while i < len(items):
        if not is_map(items[i][1], ctx):
            out.append(items[i])
            i += 1
            continue
        run = [i]
        j = i + 1
        while j < len(items):
            if is_transparent(items[j][1]):
                j += 1
                continue
            if is_map(items[j][1], ctx) and _same_family(items[run[-1]][1], items[j][1]):
                run.append(j)
                j += 1
                continue
            break
        for seg in plan_run([items[k] for k in run], ctx):
            merged = merge_segment([items[run[k]] for k in seg], ctx) if len(seg) > 1 else None
            if merged is None:  # one map, or a merge the latency probe refused: the pieces stay
                out.extend(items[run[seg[0]]:run[seg[-1]] + 1])
            else:
                out.append(merged)
                changed = True
            # dropouts inside a merged segment go; those between segments stay
            nxt = run[seg[-1] + 1] if seg[-1] + 1 < len(run) else j
            out.extend(items[run[seg[-1]] + 1:nxt])
        i = j
    return out, changed


def segment_cost(maps: list[nn.Module], ctx: FoldContext) -> tuple[Cost | None, str]:
    """The cost of ``maps`` merged into one layer, or ``None`` and why they cannot merge."""
    last = maps[-1]
    out = ctx.probe.out_shape.get(id(last))
    if out is None:
        return None, "no shape recorded"
    has_bias = any(m.bias is not None for m in maps)
    if is_dense(maps[0]):
        first_in, last_out = dense_shape(maps[0])[1], dense_shape(last)[0]
        rows = math.prod(out) // last_out
        return Cost(2.0 * first_in * last_out * rows, 1, first_in * last_out + has_bias * last_out), ""
    descs = [ConvDesc.of(m) for m in maps]
    plan, reason = chain_plan(descs, border_exact=ctx.objective.border_exact)
    if plan is None:
        return None, reason
    cost = Cost(2.0 * math.prod(out) * plan.weight.shape[1] * math.prod(plan.kernel), 1,
                plan.weight.numel() + has_bias * plan.out_channels)
    if needs_border_correction(descs):
        inp = ctx.probe.in_shape.get(id(maps[0]))
        if inp is None:
            return None, "no shape recorded"
        border = border_flops(tuple(inp[2:]), inp[0], *descs)
        two = sum(ctx.flops(m) for m in maps)
        if border >= two:  # the strips' first -> second path would be the whole pair again
            return None, (
                f"the {'x'.join(map(str, inp[2:]))} map is nearly all border: the border correction "
                f"({border:,} FLOPs) would cost at least as much as the two convs ({two:,})"
            )
        copies = sum(p.numel() for m in maps for p in m.parameters()) - (maps[1].bias.numel() if has_bias and
                                                                         maps[1].bias is not None else 0)
        cost = Cost(cost.flops + border, 1, cost.params + copies)
    return cost, ""


def plan_run(run: list[Item], ctx: FoldContext) -> list[list[int]]:
    """Best split of a run of adjacent maps into merged segments (dynamic program over segments);
    reports why neighbouring segments were not merged."""
    maps = [m for _, m in run]
    r = len(maps)
    best: list[tuple[Cost, list[list[int]]]] = [(Cost(), [])]
    reasons: dict[tuple[int, int], str] = {}
    for j in range(1, r + 1):
        cand = None
        for i in range(j):
            if j - i == 1:
                cost = ctx.cost(maps[i])
            else:
                cost, why = segment_cost(maps[i:j], ctx)
                if why:
                    reasons[(i, j)] = why
                if cost is None:
                    continue
            prev_cost, prev_plan = best[i]
            total = prev_cost + cost
            if cand is None or ctx.better(total, cand[0]):
                cand = (total, prev_plan + [list(range(i, j))])
        best.append(cand)
    plan = best[r][1]
    names = [n for n, _ in run]
    for seg_a, seg_b in zip(plan, plan[1:]):
        i, j = seg_a[-1], seg_b[0]
        merged = segment_cost(maps[i:j + 1], ctx)[0]
        why = reasons.get((i, j + 1)) or (
            f"merging would not lower the {ctx.objective} "
            f"(FLOPs {ctx.flops(maps[i]) + ctx.flops(maps[j]):,.0f} -> {merged.flops if merged else math.inf:,.0f})"
        )
        ctx.skipped(f"not merged ({why})", f"{names[i]} + {names[j]}")
    return plan


def merge_segment(seg: list[Item], ctx: FoldContext) -> Item | None:
    """``seg``'s maps merged into one layer (named as the first), or ``None`` where
    :meth:`FoldContext.keep_merge` refuses it (slower when timed)."""
    names = [n for n, _ in seg]
    maps = [m for _, m in seg]
    before = sum(ctx.flops(m) for m in maps)
    after = segment_cost(maps, ctx)[0].flops
    if is_dense(maps[0]):
        w, b = dense_wb(maps[0])
        for m in maps[1:]:
            w2, b2 = dense_wb(m)
            b = (w2 @ b if b is not None else None)
            b = b2 if b is None else (b if b2 is None else b + b2)
            w = w2 @ w
        new = make_linear(w, b, maps[-1])
        kind = f"Linear({w.shape[1]}, {w.shape[0]})"
    else:
        new, kind = merge_convs(maps, ctx.probe.in_shape.get(id(maps[0])))
    if not ctx.keep_merge(f"merged into one {kind}", maps, new, (before, after), " o ".join(reversed(names))):
        return None
    ctx.probe.register(new, like=maps[-1], first=maps[0])
    return names[0], new

