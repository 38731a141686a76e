"""CORS as llama-server answers it, with header names in their canonical casing.

llama-server (cpp-httplib) answers every ``OPTIONS`` request itself, before the loading and
API-key checks: 200, an empty ``text/html`` body, ``Access-Control-Allow-Origin``,
``-Credentials``, ``-Methods`` and ``-Headers``. Every other response carries
``Access-Control-Allow-Origin``. Header names go on the wire as ``Access-Control-Allow-Origin``,
not lowercased: HTTP says names are case-insensitive, but some clients compare them as written,
which is why this is not Starlette's ``CORSMiddleware`` (it lowercases them).

Origins: ``*`` with credentials echoes the request's ``Origin`` (so credentials work), ``*``
without them is sent as ``*``, ``localhost`` echoes only local origins, and a comma list echoes an
origin that is in it (llama-server sends the list itself, which no browser accepts; the origins it
allows are the same). ``--cors-methods`` and ``--cors-headers`` go out as configured: a preflight
gets ``Access-Control-Allow-Headers: *`` by default whatever it asks for, as from llama-server,
and browser apps written against llama-server expect exactly that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_LOCAL_ORIGIN = re.compile(r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?")


@dataclass(frozen=True)
class CorsPolicy:
    """``--cors-origins``, ``--cors-methods``, ``--cors-headers``, ``--cors-credentials``."""

    origins: str = "*"
    methods: str = "GET, POST, DELETE, OPTIONS"
    headers: str = "*"
    credentials: bool = True

    @classmethod
    def from_settings(cls, settings: Any) -> "CorsPolicy":
        from mlxcel_compat.settings import cors_origins

        return cls(
            origins=cors_origins(settings).strip(),
            methods=settings.cors_methods.strip(),
            headers=settings.cors_headers.strip(),
            credentials=bool(settings.cors_credentials),
        )

    def allow_origin(self, origin: str) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for a request's ``Origin`` (None: omit)."""
        if self.origins == "*" and not self.credentials:
            return "*"
        if not origin:
            return None
        if self.origins == "*":
            return origin
        if self.origins == "localhost":
            return origin if _LOCAL_ORIGIN.fullmatch(origin) else None
        allowed = [o.strip() for o in self.origins.split(",")]
        return origin if origin in allowed else None


class CorsMiddleware:
    def __init__(self, app: ASGIApp, policy: CorsPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v.decode("latin-1") for k, v in scope["headers"]}
        allow_origin = self.policy.allow_origin(headers.get(b"origin", ""))
        if scope["method"] == "OPTIONS":
            await self._preflight(send, allow_origin)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start" and allow_origin is not None:
                extra = [(b"Access-Control-Allow-Origin", allow_origin.encode("latin-1"))]
                if self.policy.credentials:
                    extra.append((b"Access-Control-Allow-Credentials", b"true"))
                extra.append((b"Vary", b"Origin"))
                message["headers"] = list(message.get("headers", [])) + extra
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _preflight(self, send: Send, allow_origin: str | None) -> None:
        policy = self.policy
        headers = [(b"Content-Type", b"text/html"), (b"Content-Length", b"0")]
        if allow_origin is not None:
            headers += [(b"Access-Control-Allow-Origin", allow_origin.encode("latin-1")), (b"Vary", b"Origin")]
        headers += [
            (b"Access-Control-Allow-Credentials", b"true" if policy.credentials else b"false"),
            (b"Access-Control-Allow-Methods", policy.methods.encode("latin-1")),
            (b"Access-Control-Allow-Headers", policy.headers.encode("latin-1")),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
