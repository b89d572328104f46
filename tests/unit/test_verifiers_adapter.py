"""The verifiers adapter without the `asyncrl[verifiers]` extra: one clear error naming the fix. (With the
extra, tests/integration/test_verifiers.py runs it for real: `pytest -m verifiers`.)"""

from __future__ import annotations

import importlib.util

import pytest

from asyncrl.environments import load_environment
from asyncrl.errors import AsyncRLError


@pytest.mark.skipif(importlib.util.find_spec("verifiers") is not None, reason="verifiers is installed here")
def test_without_verifiers_the_adapter_says_how_to_install_it():
    with pytest.raises(AsyncRLError, match=r"pip install 'asyncrl\[verifiers\]'"):
        load_environment("verifiers", taskset="vf-reverse-text")
