"""The optimizers of a parallelized model, each owning its clipping: ``build`` (AdamW over the trainable
sharded parameters, two weight-decay groups), ``flat_adamw`` (one fused update per group over the one-rank
flat buffers, the clipping coefficient folded into it), ``adamw_8bit`` (torchao's 8-bit AdamW for sharded
parameters) and ``clipping`` (one global norm over gradients on different meshes; an optimizer with its own
``clip_grad_norm_`` is handed the call).

Layer: above ``parallel`` (the one-rank flat buffers, FP8's per-step hook) and ``kernels``; below ``train``.
"""
