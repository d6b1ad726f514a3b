"""Errors a user can cause. Each message names the setting, the value and the fix."""

from __future__ import annotations


class NdParallelError(ValueError):
    """Base class: anything the user can fix by changing a setting, a file or the launch command."""


class ConfigError(NdParallelError):
    """A configuration value is invalid or contradicts another one."""


class LayoutError(ConfigError):
    """The parallel layout does not fit the world size or the model."""


class DataError(NdParallelError):
    """A dataset is missing, empty or malformed."""


class ModelError(NdParallelError):
    """A model directory, architecture or weight file cannot be used."""


class CheckpointError(NdParallelError):
    """A checkpoint is missing, partial, corrupted or does not match the model."""


class OutputError(NdParallelError):
    """A path ndparallel writes is a link or of the wrong kind, or holds files ndparallel did not write."""


class NumericsError(RuntimeError):
    """Training produced a non-finite loss or gradient norm."""
