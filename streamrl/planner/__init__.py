"""Resource planner: Algorithm 1 allocation (single and cross DC, heterogeneous) and elastic scaling."""

from streamrl.planner.allocation import (
    OBJECTIVES,
    Allocation,
    PlanResult,
    Pool,
    StageEstimator,
    Workload,
    plan,
    shrink_faster,
    single_dc,
)
from streamrl.planner.elastic import ElasticController, ElasticRun, ElasticStep, run_elastic

__all__ = [
    "OBJECTIVES",
    "Allocation",
    "ElasticController",
    "ElasticRun",
    "ElasticStep",
    "PlanResult",
    "Pool",
    "StageEstimator",
    "Workload",
    "plan",
    "run_elastic",
    "shrink_faster",
    "single_dc",
]
