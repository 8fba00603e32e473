"""Benchmarks and checks, each a script ending with a `RESULT key=value ...`
line; measured results go to experiments/RESULTS.md. Run them from the
checkout (`python experiments/bench_modes.py --quick`); shared helpers are
imported as `experiments.<module>` (the package is installed with
streamrl) and the tiny PPO workload they share is `streamrl/workload.py`.
"""
