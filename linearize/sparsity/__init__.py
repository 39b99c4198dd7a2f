"""Sparsity pressure on the slopes of linearizable units: the :class:`Sparsifier` and its parts.

The Sparsifier (the training-time object) pushes the slopes towards 1 and projects them on a target; what
it decides with, it asks the others:

==================  ======================================================================================
module              what it holds
==================  ======================================================================================
``sparsifier``      :class:`Sparsifier`: attach to an optimizer, step (push, project, log), penalty,
                    history, ``state_dict`` / ``load_state_dict`` (assembled from the parts below)
``selection``       which channels a target makes linear: importance objects (``select="slope"``,
                    ``"saliency"`` with its running Fisher state and its saved part); a new kind is an
                    :class:`~linearize.sparsity.selection.Importance` registered in ``SELECTIONS``
``projection``      the gentle target projection: ranking, whole groups, glide up (``max_step``), release,
                    glide down outside a cost plan
``planning``        the cost planner of ``target(flops=...)`` / ``target(latency=...)`` and its saved part;
                    the only module here that folds (imports :func:`linearize.fold`)
``relus``           the ReLU budget of ``target(relus=N)``: elements per sample of every channel (one forward
                    on ``example_inputs``), how many ranked channels go linear, its saved part
``weights``         cost weights and groups: :func:`flops_weights`, :func:`latency_weights`,
                    :func:`site_groups`, :func:`param_groups`
``state``           the checks of a saved state's common keys (each part checks its own)
==================  ======================================================================================

What is wanted at step ``t`` (the pressure, a target's fraction or cost, its ramp) is asked of the
schedule itself (:meth:`linearize.schedules.Schedule.pressure`, :meth:`~linearize.schedules.Schedule.wanted`).

Where the code said otherwise than a clean cut: ``weights`` also reads two leaf tables of
:mod:`linearize.folding` (fold's multiply-add counter, so that ``weights="flops"`` counts layers as fold
counts them, and fold's registry of residual block classes for ``granularity="block"``); it never folds.
The old module :mod:`linearize.sparsifier` re-exports these names.
"""

from .sparsifier import GRANULARITY, LINEAR_ENDS, MODES, Sparsifier, adaptive, torch_optimizer
from .selection import SELECT, SELECTIONS, Importance
from .weights import flops_weights, latency_weights, param_groups, site_groups

__all__ = ["Sparsifier", "param_groups", "flops_weights", "latency_weights", "site_groups", "torch_optimizer", "adaptive",
           "LINEAR_ENDS",
           "Importance", "SELECTIONS", "SELECT", "MODES", "GRANULARITY"]
