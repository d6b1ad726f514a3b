"""The training configuration: a typed schema with Axolotl's field names, its sections one module each
(``sections/``), its own rules in ``rules.py``.

Every field has a docstring (``ndparallel validate --help-fields`` prints them). Unknown keys are errors
that suggest the nearest valid name; wrong types and ranges name the field. ``tp_size`` / ``cp_size``
(Accelerate's names) are accepted for ``tensor_parallel_size`` / ``context_parallel_size``.
"""

from __future__ import annotations

from pydantic import ConfigDict, model_validator

from ndparallel.config.rules import config_problems
from ndparallel.config.sections.adapters import AdapterSettings
from ndparallel.config.sections.data import DataSettings
from ndparallel.config.sections.layout import LayoutSettings
from ndparallel.config.sections.memory import MemorySettings
from ndparallel.config.sections.model import ModelSettings
from ndparallel.config.sections.output import OutputSettings, TrackingSettings
from ndparallel.config.sections.schedule import ScheduleSettings

SECTIONS = (
    ModelSettings,
    DataSettings,
    ScheduleSettings,
    MemorySettings,
    LayoutSettings,
    OutputSettings,
    TrackingSettings,
    AdapterSettings,
)
"""The sections, in the order their fields are listed (``--help-fields``, a checkpoint's config.yaml)."""


# pydantic lists the fields of the last base first: the bases in reverse keep the order of SECTIONS.
class TrainConfig(
    AdapterSettings,
    TrackingSettings,
    OutputSettings,
    LayoutSettings,
    MemorySettings,
    ScheduleSettings,
    DataSettings,
    ModelSettings,
):
    """Everything ``ndparallel train`` reads. Field names and meanings follow Axolotl where Axolotl has one."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)

    @model_validator(mode="after")
    def _consistent(self) -> "TrainConfig":
        for problem in config_problems(self):
            raise ValueError(problem)
        return self
