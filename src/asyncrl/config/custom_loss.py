"""`loss.custom = 'module:function'`: the user's loss function, imported. The schema imports it while the
config loads, so that a bad path fails then and not at the trainer's first step; the trainer calls it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_loss(path: str) -> Callable[..., Any]:
    """The function named by 'module:function' (loss.custom); a bad path is one clear error."""
    module_name, _, function_name = path.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"loss.custom = {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"loss.custom = {path!r}: cannot import {module_name!r} ({error})") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"loss.custom = {path!r}: {module_name!r} has no function {function_name!r}")
    return function
