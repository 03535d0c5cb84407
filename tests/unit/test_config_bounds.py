"""Every float setting is finite, from every source, by one rule; the thresholds refuse NaN themselves;
a configuration file is read only if it is a regular file of bounded size."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from pathlib import Path

import pytest

from fleetscope.config import Config, ConfigError, load_config
from fleetscope.streams.analysis.noise import NoiseConfig
from fleetscope.streams.analysis.signals import ScoringConfig


def float_settings(cls: type = Config, prefix: str = "") -> list[str]:
    """Every float field of the configuration, as a dotted key (the list grows with the configuration)."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            out += float_settings(tp, f"{prefix}{f.name}.")
        elif tp is float:
            out.append(f"{prefix}{f.name}")
    return out


def test_every_float_setting_refuses_non_finite_values_from_every_source(tmp_path: Path) -> None:
    keys = float_settings()
    assert "streams.differential.scoring.z_threshold" in keys and "streams.differential.noise.z" in keys
    for key in keys:
        *table, name = key.split(".")
        toml = tmp_path / "c.toml"
        toml.write_text(f"[{'.'.join(table)}]\n{name} = nan\n")
        as_json = tmp_path / "c.json"
        doc: dict[str, typing.Any] = {name: math.inf}
        for part in reversed(table):
            doc = {part: doc}
        as_json.write_text(json.dumps(doc))  # Infinity
        env = {"FLEETSCOPE__" + "__".join(p.upper() for p in key.split(".")): "nan"}
        for source in ({"path": toml}, {"path": as_json}, {"env": env}, {"overrides": {key: "-inf"}}):
            with pytest.raises(ConfigError) as info:
                load_config(**{"env": {}, **source})  # type: ignore[arg-type]
            (error,) = info.value.errors  # one error, at the key: not a later bound that NaN happened to fail
            assert error.startswith(f"{key}: expected a finite number, got "), (source, error)
    assert load_config(env={}, overrides={keys[0]: "2.5"}) is not None  # a finite value still passes


def test_a_built_section_with_a_non_finite_float_is_refused_once() -> None:
    """A section given as an object (not coerced key by key) is checked by the same rule, built."""
    scoring = ScoringConfig(rel_scale_floor=math.nan)  # a field without a bound of its own
    with pytest.raises(ConfigError, match="streams.differential.scoring.rel_scale_floor: expected a finite"):
        load_config(env={}, overrides={"streams.differential.scoring": scoring})


@pytest.mark.parametrize("field", ["z", "level_z", "last_z", "lead_alarm"])
def test_noise_thresholds_refuse_nan(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}.* > 0"):
        NoiseConfig(**{field: math.nan})


def test_the_scoring_threshold_refuses_nan() -> None:
    with pytest.raises(ValueError, match="z_threshold must be > 0"):
        ScoringConfig(z_threshold=math.nan)


def test_a_config_file_is_a_regular_file_of_bounded_size(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config("/dev/zero", env={})
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(tmp_path, env={})
    big = tmp_path / "big.toml"
    big.write_text("# comment\n" * (2**20 // 10 + 1))
    with pytest.raises(ConfigError, match=f"larger than {2**20} bytes"):
        load_config(big, env={})
