"""Experiment logging: metrics to TensorBoard and JSON lines, the console, run summaries.

writer = MetricsWriter(f"{workdir}/tb", purge_step=resumed_step + 1)
writer.scalars(step, {"reward/mean": 0.4, **percentiles(lengths, prefix="response_length/")})
configure_logging(workdir)          # our lines on the console, the libraries' in a file
bar = Progress(total=config.num_iterations, desc="ppo", initial=resumed_step)

config.py     the `log.*` settings (`Log`)
writer.py     `MetricsWriter` (TensorBoard, metrics.jsonl, W&B) and `save_config`
logs.py       the console for StreamRL's lines, <workdir>/libraries.log for the rest
progress.py   the console progress bar
summaries.py  percentiles, a finished run's final metrics, a sweep's results table
"""

from streamrl.metrics.config import WANDB_MODES, Log
from streamrl.metrics.logs import (
    LIBRARY_LOG_NAME,
    OWN_LOGGERS,
    adopt_library_loggers,
    configure_actor_logging,
    configure_logging,
    output_to_library_log,
    point_output_at,
)
from streamrl.metrics.progress import Progress
from streamrl.metrics.summaries import (
    FINAL_METRICS_NAME,
    SUMMARY_METRICS,
    percentiles,
    read_final_metrics,
    results_table,
)
from streamrl.metrics.writer import JSONL_NAME, MetricsWriter, save_config, scalar

__all__ = [
    "FINAL_METRICS_NAME",
    "JSONL_NAME",
    "LIBRARY_LOG_NAME",
    "OWN_LOGGERS",
    "SUMMARY_METRICS",
    "WANDB_MODES",
    "Log",
    "MetricsWriter",
    "Progress",
    "adopt_library_loggers",
    "configure_actor_logging",
    "configure_logging",
    "output_to_library_log",
    "percentiles",
    "point_output_at",
    "read_final_metrics",
    "results_table",
    "save_config",
    "scalar",
]
