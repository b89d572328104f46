"""Who may use the server: the API key of the OpenAI and generate routes (`inference.api_key`, as vLLM's
`--api-key`) and the admin token of the /admin routes, each sent as `Authorization: Bearer <secret>`."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Callable

from fastapi import Request

from asyncrl.config.schema import InferenceConfig
from asyncrl.inference.api.api_errors import APIError

log = logging.getLogger("asyncrl.inference")


def api_key(cfg: InferenceConfig) -> str | None:
    return cfg.api_key or os.environ.get("ASYNCRL_API_KEY") or None


def admin_token(cfg: InferenceConfig) -> str | None:
    return cfg.admin_token or os.environ.get("ASYNCRL_ADMIN_TOKEN") or None


def bearer(request: Request) -> str:
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    return secret.strip() if scheme.lower() == "bearer" else ""


def _matches(given: str, secret: str) -> bool:
    return hmac.compare_digest(given.encode(), secret.encode())


def api_key_guard(cfg: InferenceConfig) -> Callable[[Request], None]:
    """The dependency of the OpenAI and generate routes: open without a key, else the key as a bearer token."""
    key = api_key(cfg)

    def require_api_key(request: Request) -> None:
        if key is not None and not _matches(bearer(request), key):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <inference.api_key>')")

    return require_api_key


def admin_guard(cfg: InferenceConfig) -> Callable[[Request], None]:
    """The dependency of the /admin routes: the run's admin token as a bearer token; no token, no admin."""
    token = admin_token(cfg)

    def require_admin(request: Request) -> None:
        if token is None:
            raise APIError(
                403,
                "admin routes are disabled: set inference.admin_token or the "
                "ASYNCRL_ADMIN_TOKEN environment variable of the server",
            )
        if not _matches(bearer(request), token):
            raise APIError(401, "missing or wrong admin token (send 'Authorization: Bearer <token>')")

    return require_admin


def warn_if_exposed(cfg: InferenceConfig, address: str) -> None:
    """Anyone who can reach a non-loopback address can generate, unless a key is required."""
    try:
        loopback = ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        loopback = False
    if not loopback and api_key(cfg) is None:
        log.warning(
            "listening on %s without an API key: anyone who can reach it can generate (set inference.api_key, "
            "or bind inference.host = 127.0.0.1)",
            address,
        )
