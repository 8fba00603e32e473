"""Discrete-event simulator of disaggregated RL at cluster scale.

config.py      SimConfig: one simulated run, named as the run settings
hardware.py    GPU types, links, model shapes
costs.py       generation, training and weight-transfer cost models
lengths.py     output-length distributions
ranker_model.py  the simulated length ranker's noise
plans.py       each round's plan (the project's scheduler)
generation.py  the generation phase: continuous batching per instance
partial.py     partial rollouts' prompt groups across rounds
engine.py      the simulation loop: rounds, trainer, modes (`simulate`)
systems.py     the paper's systems as SimConfigs
calibrate.py   cost models from measurements, predicted throughput
elastic.py     the elastic policy as a simulation controller
best_split.py  Algorithm 2's split chosen in hindsight
"""

from streamrl.sim.best_split import best_split_makespan
from streamrl.sim.calibrate import from_measured, predict_elastic_throughput, predict_local_throughput
from streamrl.sim.config import MODES, SCHEDULERS, SimConfig, ToolModel
from streamrl.sim.costs import (
    GenCalibration,
    GenCostModel,
    TrainCostModel,
    calibrate_from_ptl_curve,
    paper_calibration,
    weight_transfer_seconds,
)
from streamrl.sim.engine import IterationStats, SimResult, simulate
from streamrl.sim.generation import GenResult, simulate_generation
from streamrl.sim.hardware import (
    GPUS,
    MODELS,
    GpuSpec,
    LinkSpec,
    ModelSpec,
    default_tp,
    get_gpu,
    get_model,
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
    "ToolModel",
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
    "predict_elastic_throughput",
    "predict_local_throughput",
    "simulate",
    "simulate_generation",
    "weight_transfer_seconds",
]
