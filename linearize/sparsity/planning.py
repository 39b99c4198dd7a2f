"""The cost planner of ``target(flops=...)`` / ``target(latency=...)``: which groups of sites go linear.

The only module of :mod:`linearize.sparsity` that folds (:func:`linearize.fold`): it measures the cost of
the model folded with a set of groups linear, as a fraction of the original model folded, plans once at
the target's start which groups go linear and in which order (a modified greedy for the covering
knapsack; see :class:`~linearize.Sparsifier`), and tells the projection, at each step, which groups the
path holds linear. Its part of the Sparsifier's state (plan, costs, reference) is saved and checked here.
"""

from __future__ import annotations

import copy
import heapq
import math
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from .. import schedules as _schedules
from ..checks import finite_nonnegative
from ..distributed import full_copy
from ..folding.core import fold_in_place
from ..inputs import map_tensors
from ..timing import busy_cpu, median_latency_ms
from ..unit import LinearizableActivation, fixed_values, project_slopes, require_units
from .selection import Importance

__all__ = ["CostPlanner", "greedy", "check_cost_arguments", "check_plan", "no_plan", "SLOPE_SPREAD", "LATENCY_BUDGET_S",
           "LATENCY_CONFIRM_S"]

# free slopes closer together than this when a cost plan is made with select="slope": the slope gaps of
# the groups are their channel counts give or take this much, so the plan says it ranks by count alone
SLOPE_SPREAD = 0.1
LATENCY_BUDGET_S = 0.3  # seconds of repetitions per folded model a latency target times
# seconds of repetitions when a latency plan's last set is timed again, on its own, before it is used
LATENCY_CONFIRM_S = 1.5


def no_plan() -> dict:
    """The planner's part of a :meth:`Sparsifier.state_dict` without a cost target (the keys of
    :meth:`CostPlanner.state_dict`)."""
    return {"cost": None, "cost_reference": None, "cost_reference_of": "original", "plan": None, "plan_start": [],
            "plan_costs": None}


def check_cost_arguments(schedule: _schedules.Schedule, model: nn.Module, granularity: str, example_inputs) -> None:
    """Refuse a cost target the planner cannot measure: per channel, or without inputs."""
    cost = schedule.cost
    if cost is None:
        return
    if granularity == "channel":
        raise ValueError(f"a cost target (target({cost}=...)) makes whole sites linear, the only linearity "
                         "fold removes: pass granularity='site' or granularity='block'")
    if example_inputs is None:
        raise ValueError(f"a cost target (target({cost}=...)) folds the model to measure its cost: pass "
                         "example_inputs= (one small batch shaped like the real inputs)")


def check_plan(state: Mapping, groups: int) -> None:
    """A cost target's plan in ``state``: distinct group indices in ``[0, groups)``, one cost per plan prefix."""
    def group_ids(key: str) -> list:
        ids = state.get(key) or []
        if not isinstance(ids, list) or not all(isinstance(g, int) and not isinstance(g, bool) and g in range(groups)
                                                for g in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"state's {key} must list distinct group indices in [0, {groups})")
        return ids

    plan, _ = group_ids("plan"), group_ids("plan_start")
    costs = state.get("plan_costs")
    if state.get("plan") is None:
        if costs is not None:
            raise ValueError("state has plan_costs but no plan")
        return
    if not finite_nonnegative(costs, len(plan) + 1):
        raise ValueError(f"state's plan_costs must be {len(plan) + 1} finite costs >= 0 (one per prefix of the plan)")


class CostPlanner:
    """Plans and holds a cost target (the schedule's ``cost`` and ``goal``) over groups of units.

    A model sharded by FSDP2 is planned alike on every rank: each folds whole copies of it
    (:func:`~linearize.distributed.full_copy`, gathered to the CPU once per plan). Under
    ``torch.distributed`` (DDP or FSDP2) a latency plan is rank 0's on every process (each times its own
    latencies); every process must then build the Sparsifier and step it alike.

    Args:
        model: the converted model (folded as a float32 CPU copy for every measure).
        schedule: a cost target.
        units: the Sparsifier's ``(name, unit)`` pairs.
        groups: unit indices of each group (a site, or a block's sites).
        channel_group: the group of each channel (units in order).
        example_inputs: one small batch to fold and time the model on.
        warn: the Sparsifier's warn-once function.

    Raises ``ValueError`` when the goal is below the cost of the model with every group linear.
    """

    def __init__(self, model: nn.Module, schedule: _schedules.Target, units: list[tuple[str, LinearizableActivation]],
                 groups: list[list[int]], channel_group: torch.Tensor, example_inputs,
                 warn: Callable[[str], None]) -> None:
        self.model, self.schedule, self.units, self.groups = model, schedule, units, groups
        self.channel_group, self.warn = channel_group, warn
        self.inputs = map_tensors(  # float32 CPU, as every folded copy
            example_inputs, lambda t: t.detach().cpu().float() if t.is_floating_point() else t.detach().cpu())
        self.original: nn.Module | None = None  # the original model folded, timed beside each other set
        self.costs: dict[frozenset | None, float] = {}  # cache: set of linear groups -> cost / original's
        self.plan: list[int] | None = None  # groups in the order they go linear
        self.plan_start: set[int] = set()  # groups linear (or frozen linear) when the plan was made
        self.plan_costs: list[float] | None = None  # cost ratio of each plan prefix (len(plan) + 1)
        self.reference: float | None = None  # the original's folded cost (FLOPs or ms)
        self.frozen_measured: torch.Tensor | None = None  # frozen values when the costs were measured
        self.base: nn.Module | None = None  # a float32 CPU copy of the model while a plan is measured
        self.check_budget()

    # ------------------------------------------------------------------ measures
    def group_frozen(self) -> tuple[list[bool], list[bool]]:
        """Per group: all its channels frozen linear; any channel frozen nonlinear (never linear). Frozen: as
        :func:`~linearize.unit.fixed_values` (a slope with ``requires_grad=False`` too)."""
        frozen = torch.cat([fixed_values(u).cpu() for _, u in self.units])
        always = [bool((frozen[self.channel_group == g] == 1).all()) for g in range(len(self.groups))]
        never = [bool((frozen[self.channel_group == g] < 1).any()) for g in range(len(self.groups))]
        return always, never

    def start_groups(self) -> list[int]:
        """Groups linear when the plan was made (kept linear), and those frozen linear."""
        return sorted(self.plan_start)

    def folded_cost(self, linear: frozenset | None) -> float:
        """Cost of the model folded (:func:`linearize.fold`) with the groups ``linear`` exactly linear and
        every other channel at slope 0, its original activation (frozen channels keep their value), as a
        fraction of the original model folded (``linear=None``: every slope 0, frozen ones too; its
        absolute cost is :attr:`reference`): FLOPs counted by fold's counter, or median CPU latencies,
        each measured interleaved with the original's (:func:`~linearize.timing.median_latency_ms`), so
        a load that comes and goes during planning changes both alike. Cached per set. Always on a
        float32 CPU copy: the model may have moved since (``accelerator.prepare``, ``.to("cuda")``,
        ``.half()``), and every cost of the plan must be measured alike."""
        if linear not in self.costs:  # the original (None, and the empty set without frozen channels): check_budget
            folded = self.fold_copy(linear)
            if self.schedule.cost == "flops":
                self.costs[linear] = float(folded.linearize_fold_summary.flops_after) / self.reference
            else:
                self.costs[linear] = self.latency_ratio(folded, LATENCY_BUDGET_S)
        return self.costs[linear]

    def latency_ratio(self, folded: nn.Module, budget_s: float) -> float:
        """``folded``'s median CPU latency over the original's, timed interleaved for ``budget_s`` seconds."""
        ref, ms = median_latency_ms([self.original, folded], self.inputs, budget_s)
        return ms / ref

    def fold_copy(self, linear: frozenset | None) -> nn.Module:
        """A float32 CPU copy of the model folded with the groups ``linear`` at slope 1, every other channel
        at 0 (frozen ones, and slopes with ``requires_grad=False``, keep their value; ``None``: all at 0,
        unfrozen). Not verified: this measures the
        folded structure; a float32 model whose own rounding exceeds fold's 1e-4 (badly conditioned
        BatchNorm) must not stop planning. Folded in place (the copy is its own), FLOPs counted only for
        a FLOPs target."""
        probe = copy.deepcopy(self.base)
        units_ = require_units(probe)
        on = {i for g in linear or () for i in self.groups[g]}
        kept = {i for i, (_, unit) in enumerate(self.units) if not unit.slope.requires_grad}
        with torch.no_grad():
            for i, (_, unit) in enumerate(units_):
                if linear is None or i not in kept:
                    unit.slope.fill_(1.0 if i in on else 0.0)
                if linear is None:
                    unit.unfreeze_()
        project_slopes(u for _, u in units_)
        return fold_in_place(probe, self.inputs, count_flops=self.schedule.cost == "flops")

    @contextmanager
    def copied(self) -> Iterator[None]:
        """Hold :attr:`base`, the float32 CPU copy every measure folds, for the time of a measure (gathered
        once under FSDP2: a collective that every rank reaches at the same step)."""
        outer = self.base is None
        if outer:
            self.base = full_copy(self.model, device="cpu").eval().float()
        try:
            yield
        finally:
            if outer:
                self.base = None

    def check_budget(self) -> None:
        """Measure the original model's cost and refuse a goal below the fully linear cost (again at the
        plan's start if channels were frozen since: the cached costs and the floor depend on them)."""
        with self.copied():
            self.costs.clear()
            self.frozen_measured = self.frozen_now()
            _, never = self.group_frozen()
            self.original = self.fold_copy(None)
            self.reference = (float(self.original.linearize_fold_summary.flops_after) if self.schedule.cost == "flops"
                              else median_latency_ms([self.original], self.inputs, LATENCY_BUDGET_S)[0])
            self.costs[None] = 1.0
            if not any(u.has_frozen() for _, u in self.units):
                self.costs[frozenset()] = 1.0  # the same model: one measure (a second would differ by its noise)
            every = frozenset(g for g in range(len(self.groups)) if not never[g])
            floor = self.folded_cost(every)
            cost, goal = self.schedule.cost, self.schedule.goal
            if goal < floor and cost == "latency":  # a time is noisy: time it again, longer, and warn, not refuse
                floor = self.costs[every] = self.latency_ratio(self.fold_copy(every), LATENCY_CONFIRM_S)
                busy = busy_cpu()
                if goal < floor:
                    self.warn(
                        f"target(latency={goal}) is below the time of this model folded with every site linear "
                        f"({floor:.4f} of the original, timed twice{', on a busy CPU: ' + busy if busy else ''}), so the "
                        f"plan will make every site it can linear and may still miss it: pass latency= of at least "
                        f"{math.ceil(floor * 1e4) / 1e4:.4f}, or plan on a quieter machine")
            elif goal < floor:
                raise ValueError(f"target({cost}={goal}) is below the cost of this model folded with every site linear "
                                 f"({floor:.4f} of the original model folded; sites frozen nonlinear stay so): pass "
                                 f"{cost}= of at least {math.ceil(floor * 1e4) / 1e4:.4f}")

    def frozen_now(self) -> torch.Tensor:
        """Every channel's frozen value, free ones as -1 (NaN would never compare equal)."""
        return torch.cat([fixed_values(u).detach().cpu() for _, u in self.units]).nan_to_num(nan=-1.0)

    # ------------------------------------------------------------------ the plan
    def make_plan(self, before: torch.Tensor, importance: Importance) -> float:
        """Choose the groups the target makes linear and the order they go (see the Sparsifier's docs);
        returns the cost now (the path's start).

        Modified greedy for the covering knapsack "least importance lost with cost <= budget": add
        groups by importance per unit of *marginal* saving (each saving from a real fold); whenever
        one group alone would reach the budget, record that completion as a candidate instead of
        adding it; keep the least important candidate, then drop every group it can do without.
        """
        with self.copied():
            busy = busy_cpu() if self.schedule.cost == "latency" else None
            if busy:
                self.warn(f"latency target: the CPU is busy while the plan times folded models ({busy}), so their "
                          "times are noisy, up to 2x either way, and the plan may miss the budget: plan on a quieter "
                          "machine (start the target when other jobs are done), or target flops= instead")
            if not torch.equal(self.frozen_now(), self.frozen_measured):
                self.check_budget()
            always, never = self.group_frozen()
            linear_before = before.cpu() == 1  # linear before this step's push: kept
            start = {g for g in range(len(self.groups))
                     if always[g] or bool(linear_before[self.channel_group == g].all())}
            self.plan_start = start
            free = torch.cat([torch.isnan(fixed_values(u)).cpu() for _, u in self.units])
            importance_ = torch.zeros(len(self.groups), dtype=torch.float64).index_add_(
                0, self.channel_group, importance.values(before, free)).tolist()
            budget = self.schedule.goal
            rest = [g for g in range(len(self.groups)) if g not in start and not never[g]]
            ranked = before.cpu()[torch.isin(self.channel_group, torch.tensor(rest, dtype=torch.long))]
            if not importance.reads_gradients and len(rest) > 1 and float(ranked.max() - ranked.min()) < SLOPE_SPREAD:
                self.warn(
                    f"the cost target plans by slope gap sum(1 - a), and every slope it can choose from lies in "
                    f"[{ranked.min().item():.3g}, {ranked.max().item():.3g}]: the groups are ranked by channel count "
                    "alone, which says nothing about what each costs the model "
                    "(on a trained CIFAR MobileNet-V2, channel count ranked the blocks against the accuracy each costs). "
                    "Pass select='saliency' (--select saliency) and start the target after some steps (e.g. start=0.05) "
                    "so that each group is ranked by its loss gradients")
            timed: dict[frozenset, float] = {}  # latency: the sets timed again, on their own
            bias = 1.0  # planning time over time again, of the sets refused so far (the mildest, once two are)
            tried: list[tuple[list[int], list[float]]] = []

            def cost(groups: set[int]) -> float:  # timed again if it was, else as planned, corrected for the bias
                key = frozenset(groups)
                return timed[key] if key in timed else self.folded_cost(key) / bias

            for _ in range(2 * len(rest) + 2):  # latency: plan again until its last set, timed again, is within budget
                plan, costs = greedy(start, list(rest), importance_, budget, cost,
                                     lazy=self.schedule.cost == "flops")  # latency: noisy, measured each round
                linear = frozenset(start | set(plan))
                if self.schedule.cost != "latency" or not plan or linear in timed:
                    break  # (no group chosen: nothing was picked among noisy times)
                timed[linear] = costs[-1] = self.latency_ratio(self.fold_copy(linear), LATENCY_CONFIRM_S)
                tried.append((plan, costs))
                if costs[-1] <= budget:
                    break
                if len(timed) >= 2:  # a steady low reading (load): correct every planning time; one glitch alone does not
                    bias = min(1.0, max(self.folded_cost(key) / t for key, t in timed.items()))
            if tried and costs[-1] > budget:
                plan, costs = min(tried, key=lambda t: t[1][-1])
                self.warn(f"latency target {budget}: no plan tried met it when timed again (the closest costs "
                          f"{costs[-1]:.3f} of the original): set a higher budget, or plan with less load on the "
                          "CPU (latencies are noisy under load)")
            self.plan, self.plan_costs = plan, costs
        if self.schedule.cost == "latency" and torch.distributed.is_available() and \
                torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            self.agree()
        return self.plan_costs[0]

    def agree(self) -> None:
        """Every process takes rank 0's plan and reference (one broadcast; DDP replicas and FSDP2 shards alike):
        FLOPs plans agree by themselves, but each process times latencies on its own."""
        shared = [(self.plan, self.plan_costs, sorted(self.plan_start), self.reference)]
        torch.distributed.broadcast_object_list(shared, src=0)
        plan, costs, start, self.reference = shared[0]
        self.plan, self.plan_costs, self.plan_start = plan, costs, set(start)

    def held(self, wanted: float, device: torch.device) -> torch.Tensor:
        """Bool per channel: in a group of the shortest plan prefix whose cost is within ``wanted`` (or
        linear at the plan's start). Warns when one of them was frozen nonlinear since the plan."""
        k = next(k for k, c in enumerate(self.plan_costs) if c <= wanted or k == len(self.plan))
        groups = torch.tensor(self.start_groups() + self.plan[:k], dtype=torch.long)
        held = torch.isin(self.channel_group.to(device), groups.to(device))
        frozen = torch.cat([fixed_values(u) for _, u in self.units]).to(device)
        if bool((held & (frozen < 1)).any()):  # frozen nonlinear since the plan was made: never linear now
            stuck = [self.units[i][0] for g in groups.tolist() for i in self.groups[g]
                     if bool((fixed_values(self.units[i][1]) < 1).any())]
            self.warn(
                f"cost target: sites {stuck} of the plan were frozen nonlinear after it was made, so the folded "
                f"model cannot reach {self.schedule.cost}={self.schedule.goal}: unfreeze them (unit.unfreeze_()), "
                "or start the target again (a new Sparsifier plans around frozen channels)")
        return held

    def outside(self, device: torch.device) -> torch.Tensor:
        """Bool per channel: in no group of the plan (nor linear at its start)."""
        planned = torch.tensor(sorted(self.plan_start.union(self.plan)), dtype=torch.long)
        return ~torch.isin(self.channel_group.to(device), planned.to(device))

    def cost_plan(self) -> list[dict] | None:
        """For each plan prefix, the groups linear (their site names) and the folded cost; ``None`` before."""
        if self.plan is None:
            return None
        names = [n for n, _ in self.units]
        sites = lambda groups: [names[i] for g in groups for i in self.groups[g]]  # noqa: E731
        return [{"sites": sites(self.start_groups() + self.plan[:k]), "cost": c}
                for k, c in enumerate(self.plan_costs)]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The planner's part of :meth:`Sparsifier.state_dict` (the keys of :func:`no_plan`)."""
        return {"cost": self.schedule.cost, "cost_reference": self.reference, "cost_reference_of": "original",
                "plan": self.plan, "plan_start": sorted(self.plan_start), "plan_costs": self.plan_costs}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore what :meth:`state_dict` saved (checked before by :func:`check_plan`)."""
        if state.get("cost_reference") is not None:  # measured before: latency would differ on a new measure
            self.reference = float(state["cost_reference"])
        self.plan = None if state.get("plan") is None else [int(g) for g in state["plan"]]
        self.plan_start = {int(g) for g in state.get("plan_start") or []}
        self.plan_costs = None if state.get("plan_costs") is None else [float(c) for c in state["plan_costs"]]


def greedy(start: set[int], rest: list[int], importance: list[float], budget: float,
           cost: Callable[[set[int]], float], lazy: bool = True) -> tuple[list[int], list[float]]:
    """The plan (groups of ``rest`` in order) and the cost of each of its prefixes (after ``start``), by
    ``cost`` of a set of linear groups (see :meth:`CostPlanner.make_plan`).

    Each round adds the group of least importance per unit of marginal saving. Savings are measured
    lazily: a group's last measured saving stands in until it would be chosen, or might complete the
    budget (within the largest change of a saving seen so far), and is then measured again; where
    savings add up (FLOPs of independent blocks) and importances differ, that is the full greedy's plan from
    about one measure per round instead of one per group (otherwise a plan of the same kind, within the budget). ``lazy=False`` measures every group each round: for noisy costs
    (latencies), where a stale time misleads the ranking (on CIFAR MobileNet-V2 x0.5 a lazy latency plan took
    5 plans and 111 folds where measuring every group took 3 and 82).

    Example (additive savings 0.5, 0.3, 0.3 of cost 1; importance 1, 1, 3; budget 0.5):
        >>> saving = [0.5, 0.3, 0.3]
        >>> greedy(set(), [0, 1, 2], [1.0, 1.0, 3.0], 0.5, lambda s: 1 - sum(saving[g] for g in s))
        ([0], [1, 0.5])
    """
    taken: list[int] = []
    best: tuple[float, list[int]] | None = (0.0, []) if cost(start) <= budget else None
    saving: dict[int, float] = {}  # each group's marginal saving when last measured
    slack = 1e-9  # the largest change of a saving between two measures seen so far (0 when savings add up)
    while best is None or best[1]:  # (while the best plan needs a group at all)
        now = cost(start | set(taken))
        lost = sum(importance[g] for g in taken)
        after: dict[int, float] = {}  # cost with one more group, measured this round

        def measure(g: int) -> None:
            nonlocal slack
            after[g] = cost(start | set(taken) | {g})
            if g in saving:
                slack = max(slack, abs(now - after[g] - saving[g]))
            saving[g] = now - after[g]

        def key(g: int) -> tuple[float, int]:  # importance per unit of saving; never measured: first
            if g not in saving:
                return -math.inf, g
            return (importance[g] / saving[g] if saving[g] > 0 else math.inf), g

        if not lazy:
            for g in rest:
                measure(g)
        # lazy evaluation: the best group by its last saving, measured again until it stays the best
        heap = [key(g) for g in rest]
        heapq.heapify(heap)
        grow = None
        while heap:
            g = heapq.heappop(heap)[1]
            if g not in after:
                measure(g)
                heapq.heappush(heap, key(g))
            elif budget < after[g] < now:
                grow = g
                break
        while True:  # completions, least importance first: a group its last saving (give or take the slack)
            near = [g for g in rest if now - saving[g] <= budget + slack  # may take to the budget, measured again
                    and (g not in after or after[g] <= budget) and (best is None or lost + importance[g] < best[0])]
            if not near:
                break
            g = min(near, key=lambda g: importance[g])  # (the first of equals in ``rest``)
            if g not in after:
                measure(g)
            elif after[g] <= budget:
                best = (lost + importance[g], taken + [g])
        if grow is None:
            break
        taken.append(grow)
        rest.remove(grow)
    plan = best[1] if best is not None else taken + rest  # rest: every group (>= the floor, checked)
    for g in sorted(plan, key=lambda g: -importance[g]):  # drop what the budget does not need
        if cost(start | set(plan) - {g}) <= budget:
            plan.remove(g)
    costs = [cost(start | set(plan[:k])) for k in range(len(plan) + 1)]
    # measured costs need not be monotone (timing noise, merges that need two sites): the path holds the
    # shortest prefix within the budget, so the plan ends there and no group is left waiting beyond it
    k = next((k for k, c in enumerate(costs) if c <= budget), len(plan))
    return plan[:k], costs[:k + 1]
