"""What a fine-tune trains beside or instead of the full weights: LoRA adapters placed like the layers they
adapt, saved and loaded in PEFT's format (``lora``, ``lora_experts`` for stacked MoE expert weights), the
weights ``unfrozen_parameters`` selects (``freeze``), and quantization-aware training's fake-quantized linears
(``qat``).

Layer: above ``models`` and ``quantized``; below ``parallel``, whose ``parallelize`` attaches them. Nothing here
reads the config file or talks to other ranks.
"""
