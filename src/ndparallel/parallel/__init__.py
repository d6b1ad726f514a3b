"""The strategies, one module each, and the one function that applies them (``apply.parallelize``).

- ``options.py`` (``ParallelOptions``) and ``rules.py`` (every rule of what composes) come first;
  ``apply.py`` runs the stages in their one order;
- one module per strategy: ``tensor``, ``expert`` (experts over ep, MoE blocks under tp), ``context`` (the
  attention function transformers calls: packed rows exact, context parallelism when cp > 1), ``fsdp``,
  ``single_rank`` (one rank without FSDP), ``float8``, ``activation_checkpoint`` (+ ``offload``, ``tiled_mlp``),
  ``compile``;
- ``sequence.py``: where a row's tokens live under cp (and tp); ``comm.py``: the autograd all-to-all;
- ``attention/``: the attention plan of packed rows, the variable-length calls and the CP methods.

Layer: above ``mesh``, ``models``, ``loss``, ``quantized`` and ``adapters``. A strategy knows nothing of the
config file (``ParallelOptions`` carries what it needs) and holds no global state.
"""
