"""The Sparsifier's old home: the names now live in :mod:`linearize.sparsity` (see its docs), kept here
so that ``from linearize.sparsifier import Sparsifier, param_groups, site_groups, ...`` keeps working."""

from .sparsity.planning import LATENCY_BUDGET_S, LATENCY_CONFIRM_S, SLOPE_SPREAD
from .sparsity.selection import SALIENCY_DECAY, SALIENCY_HYSTERESIS, SELECT
from .sparsity.sparsifier import GRANULARITY, MODES, Sparsifier, torch_optimizer
from .sparsity.weights import flops_weights, latency_weights, param_groups, site_groups

__all__ = ["Sparsifier", "param_groups", "flops_weights", "latency_weights", "site_groups", "torch_optimizer",
           "MODES", "SELECT", "GRANULARITY", "SALIENCY_DECAY", "SALIENCY_HYSTERESIS", "SLOPE_SPREAD",
           "LATENCY_BUDGET_S", "LATENCY_CONFIRM_S"]
