"""The gentle target projection: rank the free channels, glide the chosen ones to 1, release the rest.

A target's projection (:meth:`Sparsifier.step <linearize.Sparsifier.step>`) chooses the channels the
path wants linear ``G`` steps ahead, moves each chosen channel up by at most ``1 / G`` per step
(:func:`max_step`) and sets it to exactly 1 when it arrives; channels not chosen are held at most at
``1 - release``; a cost target's channels outside its plan glide down to 0 (:func:`glide_down`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["glide_steps", "max_step", "rank", "by_group", "glide", "glide_down"]


def glide_steps(glide: float, ramp_steps: int) -> int:
    """``G = ceil(glide * ramp_steps)``: a chosen channel reaches 1 within ``G`` steps (0: instantly).

    Example:
        >>> glide_steps(0.1, 1000), glide_steps(0.0, 1000)
        (100, 0)
    """
    return math.ceil(glide * ramp_steps) if glide > 0 else 0


def max_step(glide_steps_: int) -> float:
    """The most a slope rises in one step: ``1 / G`` (``inf`` for ``G = 0``, the instant projection).

    Example:
        >>> max_step(100), max_step(0)
        (0.01, inf)
    """
    return 1.0 / glide_steps_ if glide_steps_ > 0 else math.inf


def rank(ranked: torch.Tensor, keys: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``ranked`` (channel indices) sorted by each per-channel key in turn, highest first, with stable
    sorts: the last key decides first, the earlier ones break its ties.

    Example:
        >>> rank(torch.arange(3), (torch.tensor([0.0, 2.0, 1.0]), torch.tensor([1, 0, 1])))
        tensor([2, 0, 1])
    """
    for key in keys:
        ranked = ranked[torch.sort(key[ranked].double(), descending=True, stable=True).indices]
    return ranked


def by_group(ranked: torch.Tensor, k_free: int, channel_group: torch.Tensor,
             groups: int) -> tuple[torch.Tensor, int]:
    """Reorder the ranked free channels group by group (a site, or a block's sites; a group's place: the
    mean rank of its free channels) and round ``k_free`` up to whole groups.

    Example:
        >>> by_group(torch.tensor([0, 2, 1, 3]), 1, torch.tensor([0, 0, 1, 1]), 2)
        (tensor([0, 1, 2, 3]), 2)
    """
    site = channel_group.to(ranked.device)[ranked]
    position = torch.arange(len(ranked), dtype=torch.float64, device=ranked.device)
    count = torch.bincount(site, minlength=groups).double()
    score = torch.bincount(site, weights=position, minlength=groups) / count.clamp_min(1)
    order = [i for i in torch.argsort(score, stable=True).tolist() if count[i] > 0]
    members = [ranked[site == i] for i in order]
    n = 0
    for group in members:
        if n >= k_free:
            break
        n += len(group)
    return (torch.cat(members) if members else ranked), n


def glide(slopes: torch.Tensor, before: torch.Tensor, chosen: torch.Tensor, beyond: torch.Tensor,
          delta: float, release: float, at_target: bool) -> torch.Tensor:
    """The slopes after one glide step: ``chosen`` channels rise by ``delta`` from ``before`` (exactly 1
    within ``delta`` of it, and at once ``at_target``), no slope rises by more than ``delta`` from
    ``before``, and the channels ``beyond`` the choice stay at most at ``1 - release``.

    Example:
        >>> glide(torch.tensor([0.5, 0.95]), torch.tensor([0.5, 0.95]), torch.tensor([1]), torch.tensor([0]),
        ...       0.1, 0.01, False)
        tensor([0.5000, 1.0000])
    """
    new = torch.minimum(slopes, before + delta)  # the proximal step's share of the cap
    new[chosen] = torch.clamp(before[chosen] + delta, max=1.0)  # exactly 1 once within delta of 1
    if at_target:  # the path is at the target: a chosen channel the loss pulled down
        new[chosen] = 1.0  # harder than the glide arrives now (held exactly)
    new[beyond] = torch.minimum(new[beyond], torch.tensor(1.0 - release))
    return new


def glide_down(new: torch.Tensor, before: torch.Tensor, outside: torch.Tensor, delta: float,
               at_target: bool) -> None:
    """In place: the channels ``outside`` a cost plan glide down by ``delta`` from ``before`` to exactly 0
    (at once ``at_target``), back to their original activation.

    Example:
        >>> new = torch.tensor([0.5, 0.5]); glide_down(new, new.clone(), torch.tensor([False, True]), 0.1, False)
        >>> new
        tensor([0.5000, 0.4000])
    """
    new[outside] = 0.0 if at_target else torch.clamp(before[outside] - delta, min=0.0)
