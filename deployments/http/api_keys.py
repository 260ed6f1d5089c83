"""Which configured API key a request presents (http.api_keys): in the `Authorization: Bearer`
header, or, for a WebSocket from a browser (which cannot set headers), an
`openai-insecure-api-key.<key>` subprotocol. With keys set, every route but /health and /ready
asks here first."""

from __future__ import annotations

from fastapi import Request

from deployments.http.errors import APIError
from deployments.metrics import api_key_label

SUBPROTOCOL_KEY_PREFIX = "openai-insecure-api-key."


class APIKeys:
    def __init__(self, keys: list[str]):
        self.keys = keys

    def authorize(self, request: Request) -> str:
        """The request's API key label (metrics.api_key_label); 401 without a configured key."""
        key = self.presented(request.headers.get("authorization", ""))
        if self.keys and key is None:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return api_key_label(key)

    def accepted(self, authorization: str, subprotocols: list[str] = ()) -> bool:
        return not self.keys or self.presented(authorization, subprotocols) is not None

    def presented(self, authorization: str, subprotocols: list[str] = ()) -> str | None:
        """The configured key the request presents, or None (None too where no keys are configured)."""
        presented = [authorization[7:].strip()] if authorization.lower().startswith("bearer ") else []
        presented += [
            protocol.removeprefix(SUBPROTOCOL_KEY_PREFIX)
            for protocol in subprotocols
            if protocol.startswith(SUBPROTOCOL_KEY_PREFIX)
        ]
        return next((key for key in presented if key in self.keys), None)
