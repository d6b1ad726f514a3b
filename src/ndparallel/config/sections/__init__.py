"""The sections of ``TrainConfig`` (``schema.py``), one module each, in the order their fields are listed:
model, data, schedule, memory, layout, output (and tracking), adapters. Each holds its fields, their
docstrings, their single-field validators and the settings derived from them."""
