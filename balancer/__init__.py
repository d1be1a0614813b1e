"""Cost model and planners: NumPy in, (rank, microbatch) index arrays out. No Ray, no torch.distributed.

``balancer.plan(lengths, ranks=R, microbatches=M, ...)`` assigns every sample of one global batch to
a bin so every (rank, microbatch) carries the same cost; ``method`` picks ours (``balanced``) or a
reference planner (``naive``, ``zigzag``, ``kk``, ``lpt``) for side-by-side numbers. ``balancer.plan_steps``
plans many steps at once with the same plans (what the loader calls for each composition window).
"""

from balancer import balanced, kk, lpt, naive, zigzag  # noqa: F401  (register the planners)
from balancer.cost import DEFAULT_COST_MODEL, CostModel
from balancer.metrics import balance_metrics
from balancer.plan import Plan, StepError, plan, plan_steps, validate_lengths
from balancer.registry import Objective, available_methods

__all__ = [
    "CostModel",
    "DEFAULT_COST_MODEL",
    "Objective",
    "Plan",
    "StepError",
    "available_methods",
    "balance_metrics",
    "plan",
    "plan_steps",
    "validate_lengths",
]
