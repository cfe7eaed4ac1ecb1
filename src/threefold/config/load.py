"""Typed, frozen configuration: one dataclass per concern (config/sections.py), read from TOML plus
overrides.

A config is built in three layers, later ones winning: dataclass defaults, a TOML file, then
`KEY=VALUE` overrides (the CLI's options are turned into such overrides). `model.preset`
supplies the defaults of every other `model.*` field. `Config.validate(world_size)` checks the
whole thing once, fills in derived values (dp) and returns the final, frozen config. Every
mistake raises `ConfigError` naming the key and the fix.
"""

from __future__ import annotations

import json
import tomllib
import types
import typing
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Literal

from .checks import validate
from .domains import check_domains, check_value
from .sections import (CheckpointConfig, CompressConfig, DataConfig, DebugConfig, FaultConfig, ModelConfig,
                              ParallelConfig, PipelineConfig, PrecisionConfig, RematConfig, RunConfig, Sections,
                              TrainConfig)
from ..errors import ConfigError
from .presets import PRESETS

__all__ = ["CheckpointConfig", "CompressConfig", "Config", "DataConfig", "DebugConfig", "FaultConfig", "ModelConfig",
           "ParallelConfig", "PipelineConfig", "PrecisionConfig", "RematConfig", "RunConfig", "TrainConfig",
           "build_config", "load_config", "with_overrides"]


@dataclass(frozen=True)
class Config(Sections):
    """The whole configuration: its sections, read and checked."""

    def for_device(self, device_type: str) -> "Config":
        """The `auto` settings (precision, train.compile) settled for the device the run uses."""
        return replace(self, precision=self.precision.for_device(device_type),
                       train=replace(self.train, compile=self.compile_for(device_type)))

    def validate(self, world_size: int) -> "Config":
        """Check everything against `world_size`; return the config with derived values set."""
        return validate(self, world_size)

    def to_toml(self) -> str:
        """The whole config as TOML that `load_config` reads back to an equal Config."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines.extend(f"{key} = {json.dumps(value)}" for key, value in values.items())
            lines.append("")
        return "\n".join(lines)


SECTIONS: dict[str, type] = {f.name: f.type for f in fields(Config)}
_SECTION_TYPES = {name: typing.get_type_hints(Config)[name] for name in SECTIONS}
# each section's field types, resolved once (typing.get_type_hints re-evaluates every annotation per call)
_SECTION_HINTS = {name: typing.get_type_hints(kind) for name, kind in _SECTION_TYPES.items()}


# ---------------------------------------------------------------- building


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = (),
                ignore: typing.Collection[str] = ()) -> Config:
    """Defaults <- TOML file at `path` (less its sections or keys named in `ignore`) <- `KEY=VALUE` overrides."""
    raw: dict[str, dict] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("--config", f"file '{path}' does not exist; pass the path of a TOML file")
        try:
            loaded = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("--config", f"'{path}' is not valid TOML ({e})") from None
        except UnicodeDecodeError as e:  # TOML is UTF-8
            raise ConfigError("--config", f"'{path}' is not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}); "
                              "TOML files are UTF-8: save it in that encoding") from None
        except OSError as e:
            raise ConfigError("--config", f"cannot read '{path}' ({e.strerror or e}); pass a readable TOML file") \
                from None
        for section, values in loaded.items():
            if section not in SECTIONS:
                raise ConfigError(section, f"unknown config section; valid sections: {', '.join(SECTIONS)}")
            if not isinstance(values, dict):
                raise ConfigError(section, "must be a TOML table like [section]")
            for key, value in values.items():
                if section in ignore or f"{section}.{key}" in ignore:
                    continue
                raw.setdefault(section, {})[key] = _check_value(section, key, value)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(item, "overrides are KEY=VALUE, e.g. model.layers=4")
        section, _, name = key.strip().partition(".")
        _field_type(section, name)  # raises on unknown keys
        raw.setdefault(section, {})[name] = _parse_text(section, name, text.strip())
    return build_config(raw)


def build_config(raw: dict[str, dict]) -> Config:
    """A Config from {section: {key: typed value}}; `model.preset` fills the model defaults."""
    model_values = dict(raw.get("model", {}))
    preset = model_values.get("preset", ModelConfig.preset)
    defaults = _hf_model_fields(preset, model_values) if preset.startswith("hf:") else PRESETS.get(preset)
    if preset.startswith("py:"):  # a user's module (models/py_module.py): tiny's fields, model.vocab = its vocab_size
        defaults = PRESETS["tiny"]
    if defaults is None:
        raise ConfigError("model.preset", f"unknown preset '{preset}'; choose one of {', '.join(PRESETS)}, "
                          "hf:DIR for a Hugging Face model directory or py:MODULE:FACTORY for your own nn.Module")
    sections = {}
    for section, cls in _SECTION_TYPES.items():
        values = dict(raw.get(section, {}))
        if section == "model":
            values = {**defaults, **values, "preset": preset}
        sections[section] = cls(**values)
    config = Config(**sections)
    check_domains(config)  # every value inside its key's domain (domains.py): one line naming the key
    return config


def _hf_model_fields(preset: str, given: dict) -> dict:
    """The model fields of `hf:DIR` from DIR/config.json; fields given as well must agree with it."""
    from ..errors import UserError
    from .hf import model_fields

    try:
        fields_ = model_fields(Path(preset[3:]))
    except UserError as e:
        raise ConfigError("model.preset", str(e)) from None
    for key, value in given.items():
        if key == "max_seq" and fields_["position"] == "rope":
            continue  # a longer context than config.json's is a fine-tuning choice (warned: train/inputs.py)
        if key == "max_seq" and value <= fields_[key]:
            continue  # a shorter one uses part of the learned position table
        if key == "max_seq":
            raise ConfigError("model.max_seq", f"{value} exceeds the {fields_[key]} rows of {preset[3:]}'s learned "
                              "position table (n_positions in config.json), which has no rows to add; keep "
                              f"train.seq_len <= {fields_[key]}")
        if key in fields_ and fields_[key] != value:
            raise ConfigError(f"model.{key}", f"{value} contradicts {preset[3:]}/config.json ({fields_[key]}); "
                              "the model directory defines the architecture: drop the override")
    return fields_


def with_overrides(config: Config, **sections: dict) -> Config:
    """A copy of `config` with some fields replaced, e.g. with_overrides(c, train={"steps": 3})."""
    changed = {}
    for section, values in sections.items():
        for name, value in values.items():
            check_value(f"{section}.{name}", _check_value(section, name, value))
        changed[section] = replace(getattr(config, section), **values)
    return replace(config, **changed)


def _field_type(section: str, name: str):
    if section not in SECTIONS:
        raise ConfigError(f"{section}.{name}", f"unknown config section '{section}'; valid sections: {', '.join(SECTIONS)}")
    hints = _SECTION_HINTS[section]
    if name not in hints:
        raise ConfigError(f"{section}.{name}", f"unknown key; valid keys in [{section}]: {', '.join(hints)}")
    return hints[name]


def _check_value(section: str, name: str, value):
    """Type-check a value that arrived already typed (TOML, Python)."""
    return _check_kind(f"{section}.{name}", _field_type(section, name), value)


def _union_members(kind) -> tuple:
    """The members of `int | Literal["auto"]`-style fields; () for any other type."""
    return typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else ()


def _kind_name(kind) -> str:
    if typing.get_origin(kind) is Literal:
        return " or ".join(repr(c) for c in typing.get_args(kind))
    return kind.__name__


def _check_kind(key: str, kind, value):
    members = _union_members(kind)
    if members:
        for member in members:
            try:
                return _check_kind(key, member, value)
            except ConfigError:
                continue
        raise ConfigError(key, f"expected {' or '.join(map(_kind_name, members))}, got {value!r}")
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if value not in choices:
            raise ConfigError(key, f"'{value}' is not one of {', '.join(map(str, choices))}")
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(key, f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def _parse_text(section: str, name: str, text: str):
    """Parse the text of a `KEY=VALUE` override into the field's type."""
    kind = _field_type(section, name)
    key = f"{section}.{name}"
    try:
        if kind is bool or bool in _union_members(kind) and text.lower() in ("true", "false", "1", "0", "yes", "no"):
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            value = lowered in ("true", "1", "yes")
        elif kind is int or int in _union_members(kind) and text.lstrip("+-").isdigit():
            value = int(text)
        elif kind is float:
            value = float(text)
        else:
            value = text
    except ValueError:
        raise ConfigError(key, f"expected {kind.__name__}, got '{text}'") from None
    return _check_value(section, name, value)
