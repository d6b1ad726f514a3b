"""The mesh: parallel sizes -> a validated ``Layout`` (pure arithmetic, ``layout``) -> the ``Topology`` (the one
DeviceMesh and its purpose-named views, ``topology``); ``ParallelismConfig`` (``parallelism_config``) is the
same sizes as Accelerate spells them.

Layer: imports only ``errors`` and ``_compat``; knows no model and no strategy.
"""
