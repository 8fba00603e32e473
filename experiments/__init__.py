"""Benchmarks and checks as one suite: `harness.py` (common flags, the
`RESULT key=value ...` line and summary.json, engine set-up, the tiny policy,
CPU pinning) and the scripts by kind in `bench/`, `check/`, `sim/` and
`diag/`; measured results go to experiments/RESULTS.md. Run a script as
`python experiments/bench/bench_modes.py --quick` or
`python -m experiments.bench.bench_modes --quick`.
"""
