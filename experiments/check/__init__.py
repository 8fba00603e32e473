"""Checks: a run or a device does what it should (bf16, several hosts, the GPU step)."""
