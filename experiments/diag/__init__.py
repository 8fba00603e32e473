"""Diagnostics: profiles, the workload's length statistics, timeline plots."""
