"""Paths of the repository the tests read: the benchmark results they hold the planner to."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
PLANNER_MEASUREMENTS = RESULTS / "planner_memory_measurements.json"
"""The memory the implementation keeps, measured (``benchmarks/planner/planner_measure.py``); the planner's
predictions are held to these."""
