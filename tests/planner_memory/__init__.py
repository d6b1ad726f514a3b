"""The planner's memory model against measurements of this implementation (test and benchmark code).

measure.py          counts what a parallelized model keeps, storage by storage (any device)
calibration.py      a measurement row -> the planner's prediction for it; the stored rows
measurements.json   the stored rows (written by benchmarks/planner_measure.py)
"""
