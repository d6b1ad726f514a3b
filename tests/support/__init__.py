"""Helpers of the tests (imported as ``support.<module>``; pytest puts ``tests/`` on the path, see pyproject):
models and training runs with their one-process references (``scenarios``, ``moe_scenarios``,
``trainer_helpers``), every family's tiny config (``family_configs``), a hub cache built offline
(``hub_cache``), crafted hostile files (``malicious``) and the repository's paths (``paths``). Running several
ranks on CPU is ``ndparallel.testing.ranks``, shared with the benchmarks."""
