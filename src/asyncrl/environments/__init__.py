"""Environments: seeded example streams, rollouts and rubrics. `load_environment` builds one by name."""

from __future__ import annotations

import importlib
import traceback
from typing import Any

from asyncrl.environments.base import Environment, Example
from asyncrl.errors import AsyncRLError


def _builtin() -> dict[str, type[Environment]]:
    from asyncrl.environments.arithmetic import Arithmetic
    from asyncrl.environments.code import Code
    from asyncrl.environments.dataset import Dataset
    from asyncrl.environments.reverse_text import ReverseText
    from asyncrl.environments.tool_calc import ToolCalc
    from asyncrl.environments.verifiers_adapter import VerifiersEnvironment
    from asyncrl.environments.wordle import Wordle

    return {env.name: env for env in (ReverseText, Arithmetic, Wordle, ToolCalc, Code, Dataset, VerifiersEnvironment)}


def _import(path: str) -> type[Environment]:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise AsyncRLError(f"environment '{path}' could not be imported: {e}") from None
    except Exception as e:  # noqa: BLE001 - the module's own code failed while it was imported
        raise AsyncRLError(
            f"environment '{path}' could not be imported: its module raised {_where(e)}{type(e).__name__}: {e}"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AsyncRLError(f"environment '{path}' could not be imported: {module_name} has no '{attr}'") from None


def _where(error: Exception) -> str:
    """'at file.py:12: ', the line of the error's innermost frame."""
    frames = traceback.extract_tb(error.__traceback__)
    return f"at {frames[-1].filename}:{frames[-1].lineno}: " if frames else ""


def load_environment(name: str, **args: Any) -> Environment:
    """A built-in environment by name, or your own class by import path (`my_package.envs:Uppercase`)."""
    builtin = _builtin()
    if ":" in name:
        cls = _import(name)
    elif name in builtin:
        cls = builtin[name]
    else:
        raise AsyncRLError(
            f"unknown environment '{name}'; built in: {', '.join(builtin)} (or give an import path 'module:Class')"
        )
    try:
        return cls(**args)
    except AsyncRLError:
        raise
    except (TypeError, ValueError) as e:
        raise AsyncRLError(f"environment '{name}': bad arguments in its args: {e}") from None
    except Exception as e:  # noqa: BLE001 - the environment's own code failed while it was built
        raise AsyncRLError(f"environment '{name}' failed to build: {_where(e)}{type(e).__name__}: {e}") from None


__all__ = ["Environment", "Example", "load_environment"]
