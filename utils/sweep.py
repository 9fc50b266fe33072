"""`--sweep NAME=V1,V2,...`: several hyperparameter configurations in one compiled program.

A trainer carries the hyperparameters that change no array shape in its training state (its
`HyperParams`), so one program serves every value: the driver stacks one `HyperParams` per
configuration and vmaps over configurations x seeds. Everything else (network width, number of
environments, on/off switches) shapes the program itself and cannot vary inside it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from utils.errors import ConfigError

# Short names users type for common hyperparameters.
ALIASES = {"lr": "learning_rate"}


def _field_name(name: str) -> str:
    name = name.strip().lstrip("-").replace("-", "_")
    return ALIASES.get(name, name)


def _parse_value(text: str, name: str, current):
    """A swept value with the type of the config field it replaces."""
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--sweep {name}: {text!r} is not a number") from None
    if isinstance(current, bool) or not isinstance(current, int | float):
        raise ConfigError(f"--sweep {name}: the field is not numeric")
    if isinstance(current, int):
        if not value.is_integer():
            raise ConfigError(f"--sweep {name}: {text!r} is not an integer")
        return int(value)
    return value


def _split_spec(spec: str) -> tuple[str, list[str]]:
    name, eq, values = spec.partition("=")
    texts = [v for v in values.split(",") if v.strip()]
    if not eq or not name.strip() or not texts:  # "lr=," too: no configuration at all
        raise ConfigError(f"--sweep {spec!r}: write NAME=V1,V2,... (for example lr=1e-3,3e-4,1e-4)")
    return name, texts


def num_configs(sweep: tuple[str, ...]) -> int:
    """How many configurations `--sweep` asks for (1 without a sweep), before any checking."""
    return math.prod(len(_split_spec(spec)[1]) for spec in sweep)


def sweep_configs(config, sweepable: tuple[str, ...]) -> list[dict[str, float | int]]:
    """The Cartesian product of `config.sweep` as one {field: value} dict per configuration,
    in order (the last name varies fastest); [{}] without a sweep. Unknown and shape-changing
    fields get a ConfigError that lists what can be swept."""
    names: list[str] = []
    value_lists = []
    fields = {f.name for f in dataclasses.fields(config)}
    for spec in config.sweep:
        raw_name, texts = _split_spec(spec)
        name = _field_name(raw_name)
        if name not in sweepable:
            what = (
                "shapes the compiled program (array sizes or on/off switches), so it cannot "
                "vary inside one"
                if name in fields
                else "is not a flag of this trainer"
            )
            raise ConfigError(
                f"--sweep {raw_name}: {name} {what}; sweepable: {', '.join(sweepable)}"
            )
        if name in names:
            raise ConfigError(f"--sweep {raw_name}: {name} is given twice")
        values = [_parse_value(text, name, getattr(config, name)) for text in texts]
        if len(set(values)) != len(values):
            raise ConfigError(f"--sweep {raw_name}: a value is repeated in {spec!r}")
        names.append(name)
        value_lists.append(values)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*value_lists)]


def config_label(overrides: dict[str, float | int]) -> str:
    """A short name for one configuration, e.g. 'learning_rate=0.001 ent_coef=0'."""
    return " ".join(f"{name}={value:g}" for name, value in overrides.items())
