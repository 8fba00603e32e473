"""Discrete-event simulator of disaggregated RL at cluster scale (see engine.py)."""

from streamrl.sim.costs import (
    GPUS,
    MODELS,
    GenCalibration,
    GenCostModel,
    GpuSpec,
    LinkSpec,
    ModelSpec,
    TrainCostModel,
    calibrate_from_ptl_curve,
    default_tp,
    get_gpu,
    get_model,
    paper_calibration,
    weight_transfer_seconds,
)
from streamrl.sim.best_split import best_split_makespan
from streamrl.sim.calibrate import from_measured, predict_local_throughput
from streamrl.sim.engine import (
    MODES,
    SCHEDULERS,
    GenResult,
    IterationStats,
    SimConfig,
    SimResult,
    simulate,
    simulate_generation,
)
from streamrl.sim.lengths import EmpiricalLengths, FixedLengths, PaperLengths, from_lengths, paper_lengths

__all__ = [
    "GPUS",
    "MODELS",
    "MODES",
    "SCHEDULERS",
    "EmpiricalLengths",
    "FixedLengths",
    "GenCalibration",
    "GenCostModel",
    "GenResult",
    "GpuSpec",
    "IterationStats",
    "LinkSpec",
    "ModelSpec",
    "PaperLengths",
    "SimConfig",
    "SimResult",
    "TrainCostModel",
    "best_split_makespan",
    "calibrate_from_ptl_curve",
    "default_tp",
    "from_lengths",
    "from_measured",
    "get_gpu",
    "get_model",
    "paper_calibration",
    "paper_lengths",
    "predict_local_throughput",
    "simulate",
    "simulate_generation",
    "weight_transfer_seconds",
]
