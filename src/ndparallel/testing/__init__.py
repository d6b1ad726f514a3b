"""Helpers the tests and the benchmarks share (neither imports the other): run a function on several CPU ranks
forked from this process (``ranks``), count the memory a parallelized model keeps storage by storage
(``memory_probe``), and compare such measurements with the planner's predictions (``planner_calibration``).

Not used by training. Layer: above ``train``; it may import anything of the library, and only the tests and
the benchmarks import it.
"""
