"""Checkpoints: save and resume a training state of named objects, sharded, atomic, reshardable, optionally
asynchronous, and loaded without trusting anything read from disk.

- ``Checkpointer``: the library API (and what the trainer uses), in ``checkpointer.py``.
- ``states.py``: how models, optimizers and other objects become state dicts.
- ``codec.py``: a state dict as tensors plus a JSON skeleton (nothing is ever pickled by ndparallel).
- ``guard.py``: what loading trusts, and the checks; ``loading.py``: reading back into live objects.
- ``store.py``: the directory layout, atomic publication, ``latest``, keep-K pruning.
- ``training.py``: the trainer's states and facts (layout, model shape) on top of the Checkpointer.

Layer: above ``safe_io``, ``mesh`` and ``quantized`` (quantized base weights are left out of checkpoints);
below ``weights`` (``export`` reads checkpoints) and ``train``.
"""
