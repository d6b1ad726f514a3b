"""Frozen, quantized base weights under LoRA adapters: 4-bit NF4 (QLoRA, ``load_in_4bit``, ``nf4.py``) or 8-bit
int8 with one scale per output row (LLM.int8()'s weight format, ``load_in_8bit``, ``int8.py``); their input
gradients are custom ops (``fused.py``); ``linears.py`` quantizes a model's decoder blocks and reports it.

The same weights are quantized on every layout, and checkpoints leave them out: they are rebuilt from
base_model on resume (quantizing is deterministic). Layer: imports only ``errors`` and ``_compat``.
"""
