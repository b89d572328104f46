"""Environments: seeded example streams, rollouts and rubrics. `load_environment` builds one by name."""

from __future__ import annotations

from typing import Any

from asyncrl.environments.base import Environment, Example
from asyncrl.errors import AsyncRLError


def load_environment(name: str, **args: Any) -> Environment:
    from asyncrl.environments.reverse_text import ReverseText

    registry = {"reverse_text": ReverseText}
    if name not in registry:
        raise AsyncRLError(f"unknown environment '{name}'; built in: {', '.join(registry)}")
    try:
        return registry[name](**args)
    except TypeError as e:
        raise AsyncRLError(f"environment '{name}': bad arguments in environment.args: {e}") from None


__all__ = ["Environment", "Example", "load_environment"]
