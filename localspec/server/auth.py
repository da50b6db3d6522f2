"""API-key check: llama-server's rules (Bearer or X-Api-Key), compared in constant time."""

from __future__ import annotations

import hmac

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})


def presented_key(authorization: str | None, x_api_key: str | None) -> str:
    value = authorization or x_api_key or ""
    return value[7:] if value.startswith("Bearer ") else value


def key_matches(presented: str, expected: str) -> bool:
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))
