"""The token loss: cross-entropy summed over target tokens, vocabulary-parallel under tensor parallelism and
chunked over tokens (``cross_entropy``); lm_head and the cross-entropy fused chunk by chunk, so the (tokens x
vocabulary) logits are never held (``fused``); and ``LossHead``, the output layer that hands its input to the
fused loss (``head``).

Layer: above ``kernels`` (the Triton loss) and ``models`` (each family's logit transform); below ``parallel``,
whose tensor plan splits the head. What one training step does with these is ``step``.
"""
