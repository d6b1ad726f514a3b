"""Model-family knowledge: the parts of a decoder and its tensor-parallel plan (``decoder``), what each family
needs or refuses (``families``), mixture-of-experts facts, weights and the experts function transformers calls
(``moe``, ``moe_weights``, ``moe_experts``), tied weights (``ties``) and preset shapes (``presets``).

Layer: imports only ``errors`` and ``_compat``. No distributed code, no mesh, no strategy: what a family needs
under a parallel axis is said here as data, and applied by ``parallel``.
"""
