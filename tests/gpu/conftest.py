"""The scripts here are run by hand on a CUDA machine (``python tests/gpu/gpu_*.py``, see each docstring); the
CPU suite does not collect them."""

collect_ignore_glob = ["gpu_*.py"]
