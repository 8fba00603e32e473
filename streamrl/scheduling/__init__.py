"""Skewness-aware generation scheduling: PTL(BS) profiles, Algorithm 2, LPT."""

from streamrl.scheduling.dispatch import (
    DispatchPlan,
    calibrated_lengths,
    choose_batch_size,
    continuous_batching_time,
    continuous_batching_times,
    dispatch,
    estimate_latency,
    fifo_plan,
)
from streamrl.scheduling.latency import LatencyProfile
from streamrl.scheduling.lpt import AdmissionQueue, lpt_order
from streamrl.scheduling.policy import SCHEDULERS, plan_generation

__all__ = [
    "AdmissionQueue",
    "DispatchPlan",
    "LatencyProfile",
    "calibrated_lengths",
    "choose_batch_size",
    "continuous_batching_time",
    "continuous_batching_times",
    "dispatch",
    "estimate_latency",
    "fifo_plan",
    "lpt_order",
    "plan_generation",
    "SCHEDULERS",
]
