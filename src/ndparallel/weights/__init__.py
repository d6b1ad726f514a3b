"""Weights in and out of a layout: the model's config and its skeleton on the meta device (``meta``), each
rank's shards filled from safetensors or a seeded init that is the same on every layout (``materialize``,
``safetensors_reader``, ``shards``), the vocabulary grown for added tokens (``vocab``), pretrained models for a
user's own loop (``pretrained``), and a checkpoint exported as a Hugging Face directory (``export``).

Layer: above ``parallel`` (``pretrained`` parallelizes what it loads) and ``checkpoint`` (``export`` reads
checkpoints); below ``step``, ``train`` and the commands.
"""
