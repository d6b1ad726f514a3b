"""Reading a config: YAML (bounded, safe), ``--set`` overrides, Axolotl's spellings translated and every
other key sorted (``axolotl.py``), then the typed ``TrainConfig`` validated; every problem one line."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import AliasChoices, ValidationError

from ndparallel.config.axolotl import not_used_line, read_axolotl
from ndparallel.config.schema import SECTIONS, TrainConfig
from ndparallel.config.sections.data import DatasetConfig
from ndparallel.config.validation_errors import format_validation_error, warnings_for
from ndparallel.errors import ConfigError
from ndparallel.safe_io import bounded_yaml


def accepted_keys() -> set[str]:
    keys = set()
    for name, field in TrainConfig.model_fields.items():
        keys.add(name)
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            keys.update(a for a in alias.choices if isinstance(a, str))
    return keys


@dataclass
class ConfigReading:
    """A raw config read: the validated config (None when it has errors), every error, and the notes
    (the one "not used" line, translations that differ from Axolotl) to show the user once."""

    config: TrainConfig | None
    errors: list[str]
    notes: list[str]
    settings: dict[str, Any]


def read_config(raw: Any) -> ConfigReading:
    """Translate Axolotl's spellings, sort every other key (see ``from_axolotl``) and validate."""
    if not isinstance(raw, dict):
        return ConfigReading(None, [f"the config must be a mapping of settings, got {type(raw).__name__}"], [], {})
    reading = read_axolotl(raw, accepted_keys(), set(DatasetConfig.model_fields))
    errors = list(reading.errors)
    config = None
    try:
        config = TrainConfig.model_validate(reading.settings)
    except ValidationError as exc:
        errors += format_validation_error(exc)
    notes = [line for line in [not_used_line(reading.not_used)] if line] + reading.notes
    if config is not None and not errors:
        notes += warnings_for(config)
    return ConfigReading(None if errors else config, errors, notes, reading.settings)


def partial_config(settings: dict[str, Any]) -> TrainConfig | None:
    """The config without the settings that are invalid (their defaults instead), so that ``validate`` can go
    on to check the model, layout and data of a config that has errors; None when that is not possible."""
    settings = dict(settings)
    for _ in range(4):
        try:
            return TrainConfig.model_validate(settings)
        except ValidationError as exc:
            keys = {err["loc"][0] for err in exc.errors() if err["loc"]}
            if not keys & set(settings):
                return None
            for key in keys:
                settings.pop(key, None)
    return None


def config_errors(raw: dict) -> list[str]:
    """Every problem with a raw config mapping, one line each (empty when valid)."""
    return read_config(raw).errors


def parse_config(raw: dict) -> TrainConfig:
    reading = read_config(raw)
    if reading.errors:
        raise ConfigError("; ".join(reading.errors))
    return reading.config


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; give the path of a YAML file")
    try:
        data = bounded_yaml.load(path.read_text(encoding="utf-8"), source=f"config file {str(path)!r}")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML{where}: {getattr(exc, 'problem', exc)}"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of settings, not a {type(data).__name__}")
    return data


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``--set key=value`` overrides (values parsed as YAML; ``a.b=1`` and ``datasets.0.path=x`` nest)."""
    raw = yaml.safe_load(yaml.safe_dump(raw)) or {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} must look like key=value (e.g. --set learning_rate=1e-4)")
        key, _, text = item.partition("=")
        try:
            value = bounded_yaml.load(text, source=f"--set {key}") if text != "" else None
        except yaml.YAMLError:
            value = text
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 as a string; users mean the number
            try:
                value = float(value) if any(c in value for c in "eE.") else value
            except ValueError:
                pass
        target: Any = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            if isinstance(target, list):
                target = target[int(part)]
            else:
                target = target.setdefault(part, {})
        last = parts[-1]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
    return raw


def field_docs() -> str:
    """Every setting with its type, default and description (for --help-fields)."""
    docs: dict[str, str] = {}
    for section in SECTIONS:
        tree = ast.parse(inspect.getsource(section)).body[0]
        previous = None
        for node in tree.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                previous = node.target.id
            elif previous and isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant):
                docs[previous] = " ".join(str(node.value.value).split())
                previous = None
            else:
                previous = None
    lines = []
    for name, field in TrainConfig.model_fields.items():
        default = field.default if field.default_factory is None else field.default_factory()
        lines.append(f"{name} (default {default!r}): {docs.get(name, '')}".rstrip(": "))
    return "\n".join(lines)
