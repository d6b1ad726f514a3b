"""The training configuration: the typed schema (``schema.py``, its sections one module each in ``sections/``),
the config's own rules (``rules.py``; which strategies compose is ``parallel/rules.py``, asked from there),
reading a YAML with ``--set`` overrides (``reading.py``), Axolotl's spellings and the policy for every other
Axolotl field (``axolotl.py``, ``config/axolotl_fields.py``), Accelerate's launch settings (``accelerate.py``), and
pydantic's errors as one line per setting (``config/validation_errors.py``).

Layer: above ``mesh``, ``adapters``, ``parallel``, ``data`` (whose names and rules its fields use); below
``planner`` (which reads a config duck-typed) and ``train``. Strategies never import it: ``ParallelOptions``
carries what they need.
"""
