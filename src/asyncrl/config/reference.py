"""Render docs/config.md from the config models, so the reference never drifts from the code.

python -m asyncrl.config.reference > docs/config.md
"""

from __future__ import annotations

import typing

from pydantic import BaseModel

from asyncrl.config.loader import _submodel
from asyncrl.config.schema import (
    EnvServerConfig,
    EvalConfig,
    InferenceConfig,
    OrchestratorConfig,
    RLConfig,
    SFTConfig,
    TrainerConfig,
)

COMMANDS = [
    ("asyncrl rl", RLConfig),
    ("asyncrl inference", InferenceConfig),
    ("asyncrl orchestrator", OrchestratorConfig),
    ("asyncrl trainer", TrainerConfig),
    ("asyncrl sft", SFTConfig),
    ("asyncrl eval", EvalConfig),
    ("asyncrl env-server", EnvServerConfig),
]


def _labelled(annotation: object) -> type[BaseModel] | None:
    """The model of a `dict[str, Model]` field, whose tables are keyed by a label of the user's choosing."""
    if typing.get_origin(annotation) is dict:
        return _submodel(typing.get_args(annotation)[1])
    return None


def _rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        if (
            sub is not None
            and prefix.count(".") < 1
            and model is RLConfig
            and name in ("inference", "orchestrator", "trainer")
        ):
            rows.append(f"| `{prefix}{name}.*` | | the `asyncrl {name}` keys below |")
        elif sub is not None:
            rows.extend(_rows(sub, f"{prefix}{name}."))
        elif _labelled(field.annotation) is not None:  # dict[str, Model]: one table per label
            labels = ", ".join(field.get_default(call_default_factory=True)) or "none"
            rows.append(f"| `{prefix}{name}.<label>` | `{labels}` | {field.description or ''} |")
            rows.extend(_rows(_labelled(field.annotation), f"{prefix}{name}.<label>."))
        else:
            default = field.get_default(call_default_factory=True)
            rows.append(f"| `{prefix}{name}` | `{default!s}` | {field.description or ''} |")
    return rows


def render() -> str:
    parts = [
        "# Configuration reference",
        "",
        "Generated from `src/asyncrl/config/schema.py` by `python -m asyncrl.config.reference`; a test keeps it",
        "in sync. Set keys in TOML files (`@ file.toml`) or as flags (`--section.key value`).",
    ]
    for command, model in COMMANDS:
        parts += ["", f"## `{command}`", "", "| key | default | meaning |", "|---|---|---|", *_rows(model)]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(render(), end="")
