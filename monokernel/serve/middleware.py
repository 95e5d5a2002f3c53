"""What every HTTP request goes through before its route: its id, the API key, the refusal
while the server drains, and the replica header; and after its response: its log line and its
metrics. A plain ASGI middleware (not Starlette's BaseHTTPMiddleware), so a streamed response
passes through unbuffered and "after" means after its last byte.

- ``x-request-id``: the client's (visible ASCII, up to 128 characters) or a new one; echoed on
  the response, written in the log line, and the base of the completion's id (as vLLM does).
- The API key (``--api-key``): every route but /health needs ``Authorization: Bearer KEY``;
  otherwise a 401 in OpenAI's JSON. CORS preflight is answered before this (app.py puts
  Starlette's CORSMiddleware outside), as browsers send it without credentials.
- ``x-monokernel-replica``: which server (replica) answered.
"""

from __future__ import annotations

import hmac
import uuid

from . import protocol as P
from .observe import RequestInfo, log_request, request_line
from .worker import SHUTTING_DOWN

REPLICA_HEADER = "x-monokernel-replica"
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID = 128
OPEN_ROUTES = ("/health",)  # no API key needed: load balancers and probes call it
DRAIN_OPEN_ROUTES = ("/health", "/metrics")  # still answered while the server drains


def valid_request_id(rid: str) -> bool:
    return 0 < len(rid) <= MAX_REQUEST_ID and all(33 <= ord(c) <= 126 for c in rid)


class RequestMiddleware:
    """Wraps the FastAPI app; ``server`` is its app.Server (key, replica, metrics, drain)."""

    def __init__(self, app, server):
        self.app = app
        self.srv = server  # app.Server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        rid = headers.get(REQUEST_ID_HEADER)
        refusal = None
        if rid is not None and not valid_request_id(rid):
            refusal = P.bad_request(f"`{REQUEST_ID_HEADER}` must be 1 to {MAX_REQUEST_ID} "
                                    "visible ASCII characters", REQUEST_ID_HEADER,
                                    code="invalid_request_id")
            rid = None
        rid = rid or uuid.uuid4().hex
        info = RequestInfo(rid, scope.get("method", ""), scope.get("path", ""))
        scope["monokernel"] = info
        refusal = refusal or self.refusal(info.path, headers)
        status: list[int] = []
        extra = [(REPLICA_HEADER.encode(), self.srv.replica.encode())]
        if self.srv.echo_request_id:
            extra.append((REQUEST_ID_HEADER.encode(), rid.encode()))

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        self.srv.active += 1
        try:
            if refusal is not None:
                from starlette.responses import JSONResponse

                await JSONResponse(refusal.body(), status_code=refusal.status)(
                    scope, receive, send_with_headers)
            else:
                await self.app(scope, receive, send_with_headers)
        finally:
            self.srv.active -= 1
            # no status: the app raised before answering (Starlette's outer error handler
            # answers 500) or the client left before the headers
            line = request_line(info, status[0] if status else 500, self.srv.replica)
            self.srv.metrics.observe(line)
            log_request(line)

    def refusal(self, path: str, headers: dict[str, str]) -> P.APIError | None:
        key = self.srv.api_key
        if key and path not in OPEN_ROUTES:
            auth = headers.get("authorization", "")
            scheme, _, given = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    given.strip().encode(), key.encode()):
                what = "no API key was given" if not auth else "the API key is not valid"
                return P.APIError(401, f"{what}: send the server's key as `Authorization: "
                                  "Bearer KEY`", code="invalid_api_key",
                                  type="invalid_request_error")
        if self.srv.draining and path not in DRAIN_OPEN_ROUTES:
            return P.APIError(503, SHUTTING_DOWN, code="shutting_down")
        return None
