"""What one training step computes, as a user's own loop calls it: a global batch cut into this rank's
micro-batch (``batching``), the token-weighted loss and its reductions (``token_loss``), the MoE router's
auxiliary loss, exact across ranks (``router_loss``), which gradient reductions each micro-batch runs
(``gradient_sync``), and the FLOPs of a step for MFU (``flops``).

Layer: above ``parallel`` (the sequence split, the attention's inputs) and ``loss``; below ``optim``, ``data``,
``planner`` and ``train``.
"""
