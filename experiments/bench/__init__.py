"""Benchmarks: throughput, latency and cost of the parts and the pipeline modes."""
