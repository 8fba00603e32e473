"""Test-wide setup: 8 fake CPU devices for sharding tests, in-process vLLM."""

import os

# Must happen before JAX initialises its backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Keeps the vLLM engine in the test process: ~2 s start-up instead of ~15 s.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
