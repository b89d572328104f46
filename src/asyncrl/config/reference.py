"""Every config key of a command, with its type, default and meaning, read from the config models: rendered
as docs/config.md and as `asyncrl <command> --help`, so neither drifts from the code.

python -m asyncrl.config.reference > docs/config.md
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from asyncrl.config.loader import _submodel
from asyncrl.config.schema import (
    RL_SECTIONS,
    EnvServerConfig,
    EvalConfig,
    InferenceConfig,
    OrchestratorConfig,
    RLConfig,
    SFTConfig,
    TrainerConfig,
)

COMMANDS = {
    "rl": RLConfig,
    "inference": InferenceConfig,
    "orchestrator": OrchestratorConfig,
    "trainer": TrainerConfig,
    "sft": SFTConfig,
    "eval": EvalConfig,
    "env-server": EnvServerConfig,
}


@dataclass
class Key:
    path: str  # dotted, as a flag takes it: `trainer.optim.lr`
    type: str
    default: str
    meaning: str


def _labelled(annotation: object) -> type[BaseModel] | None:
    """The model of a `dict[str, Model]` field, whose tables are keyed by a label of the user's choosing."""
    if typing.get_origin(annotation) is dict:
        return _submodel(typing.get_args(annotation)[1])
    return None


def type_name(annotation: object) -> str:
    """A TOML-minded name for an annotation: `int`, `float or none`, `"sdpa" | "eager"`, `list of str`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin is types.UnionType or origin is typing.Union:
        named = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or none" if type(None) in args else "")
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is tuple:
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    if origin is dict or annotation is dict:
        return "table"
    if annotation is Path:
        return "path"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    return getattr(annotation, "__name__", str(annotation))


def keys(
    model: type[BaseModel], prefix: str = "", defaults: BaseModel | None = None, expand_sections: bool = False
) -> list[Key]:
    """`defaults`: the section's own default when it differs from its class's (sft's `optim` has lr 2e-3).
    An `rl` config's process sections are one row each unless `expand_sections`."""
    rows = []
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        default = getattr(defaults, name) if defaults is not None else field.get_default(call_default_factory=True)
        if sub is not None and not prefix and model is RLConfig and name in RL_SECTIONS and not expand_sections:
            rows.append(Key(f"{name}.*", "table", "", f"the `asyncrl {name}` keys"))
            # Where `asyncrl rl` gives a section's key another default than the command alone has.
            for key, value in default.model_dump(exclude_defaults=True).items():
                leaf = sub.model_fields[key]
                rows.append(Key(f"{name}.{key}", type_name(leaf.annotation), str(value), leaf.description or ""))
        elif sub is not None:
            section_default = default if isinstance(default, BaseModel) else None
            rows.extend(keys(sub, f"{prefix}{name}.", section_default, expand_sections))
        elif _labelled(field.annotation) is not None:  # dict[str, Model]: one table per label
            labels = ", ".join(default) or "none"
            rows.append(Key(f"{prefix}{name}.<label>", "table", labels, field.description or ""))
            rows.extend(keys(_labelled(field.annotation), f"{prefix}{name}.<label>."))
        else:
            rows.append(Key(f"{prefix}{name}", type_name(field.annotation), str(default), field.description or ""))
    return rows


def render() -> str:
    parts = [
        "# Configuration reference",
        "",
        "Generated from `src/asyncrl/config/schema.py` by `python -m asyncrl.config.reference`; a test keeps it",
        "in sync. Set keys in TOML files (`@ file.toml`) or as flags (`--section.key value`); `asyncrl <command>",
        "--help` prints the same list.",
    ]
    for command, model in COMMANDS.items():
        parts += ["", f"## `asyncrl {command}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for key in keys(model):
            default = f"`{key.default}`" if key.default else ""
            parts.append(f"| `{key.path}` | {key.type.replace('|', '&#124;')} | {default} | {key.meaning} |")
    return "\n".join(parts) + "\n"


def help_text(command: str, width: int = 100) -> str:
    """`asyncrl <command> --help`: usage, then each key as `--path TYPE (default D)` over its meaning."""
    import textwrap

    lines = [
        f"usage: asyncrl {command} [@ config.toml ...] [--key value ...]",
        "",
        "Config files are layered left to right, then flags override them; flag values are read as TOML.",
        "keys:",
    ]
    for key in keys(COMMANDS[command], expand_sections=True):
        default = f" (default: {key.default})" if key.default else ""
        lines.append(f"  --{key.path} {key.type}{default}")
        if key.meaning:
            lines += textwrap.wrap(key.meaning, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
