"""Build a config from defaults, `@ file.toml` layers and dotted CLI flags.

    asyncrl rl @ base.toml @ big.toml --trainer.optim.lr 1e-5 --orchestrator.environments.arithmetic.weight 2

Layers are deep-merged left to right; flags win over files. Values of flags are read as TOML values
(`3`, `1e-5`, `true`, `[1, 2]`, `"text"`) and fall back to plain strings.
"""

from __future__ import annotations

import difflib
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import tomli_w
from pydantic import BaseModel, ValidationError

from asyncrl.config.schema import RL_SECTIONS, SHARED_KEYS, RLConfig
from asyncrl.errors import AsyncRLError

C = TypeVar("C", bound=BaseModel)


class ConfigError(AsyncRLError):
    """A config that cannot be built; the message names the key and the fix."""


def parse_args(argv: list[str], command_flags: frozenset[str] = frozenset()) -> tuple[dict[str, Any], list[str]]:
    """Split argv into a merged raw dict and the command's own flags (`--dry-run`, ...)."""
    raw: dict[str, Any] = {}
    flags: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("@"):
            if arg == "@":
                if i + 1 >= len(argv):
                    raise ConfigError("'@' must be followed by a TOML file")
                i += 1
            deep_merge(raw, read_toml(Path(argv[i] if arg == "@" else arg[1:])))
        elif arg in command_flags:
            flags.append(arg)
        elif arg.startswith("--") and len(arg) > 2:
            key, value, consumed = _split_flag(argv, i)
            set_dotted(raw, key, value)
            i += consumed
        else:
            raise ConfigError(
                f"unexpected argument '{arg}' (give config files as '@ file.toml' and keys as '--section.key value')"
            )
        i += 1
    return raw, flags


def _split_flag(argv: list[str], i: int) -> tuple[str, Any, int]:
    arg = argv[i][2:]
    if "=" in arg:
        key, text = arg.split("=", 1)
        return key.replace("-", "_"), parse_value(text), 0
    key = arg.replace("-", "_")
    has_value = i + 1 < len(argv) and not (argv[i + 1].startswith("--") or argv[i + 1].startswith("@"))
    if not has_value:
        return key, True, 0
    return key, parse_value(argv[i + 1]), 1


def parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file '{path}' not found")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def deep_merge(base: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_merge(base[key], value)
        else:
            base[key] = value
    return base


def set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"'{dotted}': '{part}' is a value, not a section")
        node = child
    node[leaf] = value


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel class inside an annotation (also `X | None`), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        for arg in typing.get_args(annotation):
            found = _submodel(arg)
            if found:
                return found
    return None


def check_keys(model: type[BaseModel], raw: dict[str, Any], prefix: str = "") -> None:
    """Reject unknown keys, naming the closest valid one."""
    fields = model.model_fields
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys here: {', '.join(fields)}"
            raise ConfigError(f"unknown config key '{path}'{hint}")
        sub = _submodel(fields[key].annotation)
        if sub is not None and isinstance(value, dict):
            check_keys(sub, value, prefix=f"{path}.")


def keep_section_defaults(model: type[BaseModel], raw: dict[str, Any]) -> dict[str, Any]:
    """A section whose default differs from its class defaults (sft's `optim` has lr 2e-3) keeps those values
    for the keys a partial table leaves out: `--optim.scheduler cosine` must not reset lr to the class default."""
    for key, value in raw.items():
        field = model.model_fields[key]
        sub = _submodel(field.annotation)
        if sub is None or not isinstance(value, dict):
            continue
        if isinstance(field.default, BaseModel):
            for name, default in field.default.model_dump(exclude_defaults=True).items():
                value.setdefault(name, default)
        keep_section_defaults(sub, value)
    return raw


def build(model: type[C], raw: dict[str, Any]) -> C:
    check_keys(model, raw)
    keep_section_defaults(model, raw)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        errors = e.errors()
        failed = {(tuple(err["loc"]), err["msg"]) for err in errors}
        lines = []
        for err in errors:
            loc = tuple(err["loc"])
            # A shared key's copies in the sections of an `rl` config fail as the key does: say it once.
            if model is RLConfig and len(loc) > 1 and loc[0] in RL_SECTIONS and (loc[1:], err["msg"]) in failed:
                continue
            path = ".".join(str(p) for p in loc) or "(top level)"
            got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
            lines.append(f"{path}: {err['msg']}{got}")
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def share_rl_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """Copy the top-level shared keys of an `rl` config into each section that has them.

    A section may not contradict the top level: every process of one run must agree on the model, the
    sequence length, the step count, the seed and the output folder. Model leaves other than `name`
    (dtype, attention) may differ per section when the top level leaves them unset.
    """
    defaults = RLConfig().model_dump(mode="json")
    for key in SHARED_KEYS:
        for section in RL_SECTIONS:
            section_fields = RLConfig.model_fields[section].annotation.model_fields
            if key not in section_fields:
                continue
            sec = raw.setdefault(section, {})
            if not isinstance(sec, dict):
                raise ConfigError(f"'{section}' must be a table")
            if key == "model":
                top = raw.get("model", {})
                merged = sec.setdefault("model", {})
                for leaf, value in top.items():
                    if leaf in merged and merged[leaf] != value:
                        raise ConfigError(
                            f"{section}.model.{leaf} = {merged[leaf]!r} conflicts with model.{leaf} = {value!r}; "
                            "set it once, at the top level"
                        )
                    merged[leaf] = value
                name = top.get("name", defaults["model"]["name"])
                if merged.get("name", name) != name:
                    raise ConfigError(
                        f"{section}.model.name = {merged['name']!r} conflicts with model.name = {name!r}; "
                        "set model.name once, at the top level"
                    )
                merged["name"] = name
            else:
                value = raw.get(key, defaults[key])
                if key in sec and str(sec[key]) != str(value):
                    raise ConfigError(
                        f"{section}.{key} = {sec[key]!r} conflicts with {key} = {value!r}"
                        "; set it once, at the top level"
                    )
                sec[key] = value
    return raw


def load(model: type[C], argv: list[str], command_flags: frozenset[str] = frozenset()) -> tuple[C, list[str]]:
    """Build `model` from argv; returns the config and the command flags that were given."""
    raw, rest = parse_args(argv, command_flags)
    if model is RLConfig:
        share_rl_keys(raw)
    return build(model, raw), rest


def to_toml(config: BaseModel) -> str:
    data = config.model_dump(mode="json", exclude_none=True)
    return tomli_w.dumps(data)


def write_toml(config: BaseModel, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(config))
