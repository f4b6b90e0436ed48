"""`Guards`: ASGI middleware in front of the app. With an API key, `/v1/...` asks for `Authorization: Bearer KEY`
(401 otherwise); a request body past `max_body_bytes` is refused (413) before the app reads any of it, whether its
Content-Length says so or its chunks add up to it. The refused body is read and dropped up to DRAIN_BYTES first (a
client still sending it would otherwise see the connection reset instead of the 413), then the connection closes."""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse

from mtp_jax.serve.protocol import error_body

DRAIN_BYTES = 16 << 20


class Guards:
    def __init__(self, app, *, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        guarded = scope["path"] == "/v1" or scope["path"].startswith("/v1/")
        if self.api_key and guarded and not self.authorized(scope):
            body = error_body(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                              code="invalid_api_key")  # fmt: skip
            return await JSONResponse(body, 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self.too_large(scope, receive, send, more=True)
        first, size = None, 0
        chunks = []
        while True:  # the whole body, counted, then handed to the app as one message
            message = await receive()
            if message["type"] != "http.request":
                first = message
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return await self.too_large(scope, receive, send, more=message.get("more_body", False))
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        first = first or {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        given = False

        async def replay():
            nonlocal given
            if not given:
                given = True
                return first
            return await receive()

        return await self.app(scope, replay, send)

    def authorized(self, scope) -> bool:
        value = header(scope, b"authorization") or ""
        scheme, _, key = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode())

    async def too_large(self, scope, receive, send, more: bool):
        """The 413, after the rest of the body (`more`: some is still to come) is read and dropped."""
        drained = 0
        while more and drained <= DRAIN_BYTES:
            message = await receive()
            drained += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        body = error_body(413, f"the request body is over {self.max_body_bytes} bytes", code="request_too_large")
        await JSONResponse(body, 413, {"Connection": "close"})(scope, receive, send)


def header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
