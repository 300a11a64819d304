"""ASGI middleware in front of every route: the request body limit and the API key check."""

from __future__ import annotations

import hmac

from pagedllm.server.errors import APIError, anthropic_route, error_json

MAX_BODY_BYTES = 8 * 1024 * 1024


class BodyLimitMiddleware:
    """Refuses bodies over the limit before anything parses them (Content-Length, or counted while streaming)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await error_json(413, f"request body is larger than {self.max_bytes} bytes",
                                        path=scope["path"])(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise APIError(413, f"request body is larger than {self.max_bytes} bytes")
            return msg

        return await self.app(scope, limited_receive, send)


class DrainingMiddleware:
    """While the server stops (``state.draining``: a SIGTERM, the requests in flight finishing), new work (a POST
    under /v1/) gets a 503, so a router or load balancer sends it to another replica. Plain ASGI (see below)."""

    def __init__(self, app, state) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if (scope["type"] == "http" and self.state.draining and scope["method"] == "POST"
                and scope["path"].startswith("/v1/")):
            resp = error_json(503, "the server is stopping: finishing the requests in flight, taking no new ones",
                              path=scope["path"])
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on every route except the public ones (/health, and /metrics unless
    --metrics-require-auth); on the Anthropic Messages API routes Anthropic's `x-api-key: <key>` header is accepted
    too. The key is compared in constant time. Plain ASGI, so that disconnect detection downstream still sees the
    real receive channel."""

    def __init__(self, app, api_key: str, public_paths: frozenset[str] = frozenset({"/health"})) -> None:
        self.app, self.key, self.public = app, api_key.encode(), public_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.public:
            headers = dict(scope.get("headers", []))
            header = headers.get(b"authorization", b"")
            token = header[7:] if header[:7].lower() == b"bearer " else b""
            ok = hmac.compare_digest(token, self.key)
            if anthropic_route(scope["path"]):
                ok = hmac.compare_digest(headers.get(b"x-api-key", b""), self.key) or ok
            if not ok:
                resp = error_json(401, "Invalid or missing API key", path=scope["path"])
                resp.headers["WWW-Authenticate"] = "Bearer"
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)
