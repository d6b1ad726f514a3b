"""Attention for packed, padded and context-parallel rows, at linear cost: the plan of which query block sees
which key block, per document and window (``plan``), the variable-length kernel calls that run it (``varlen``),
and the three ways cp ranks exchange keys and values (``cp_methods``: allgather, ring, alltoall); ``simulate``
runs one cp rank's share of them in one process (GPU checks and benchmarks).

Layer: inside ``parallel``; ``parallel/context.py`` is its entry point. Reads ``sequence`` and ``comm``.
"""
