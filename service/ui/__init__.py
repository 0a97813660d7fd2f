"""The web UI, served by the API process: server-rendered pages (Jinja2, autoescaped) with a
little JavaScript (live updates from the server-sent events, lazy turns, keyboard navigation,
charts with the vendored Chart.js). Everything agents and tasks wrote is untrusted text: it is
escaped by the templates or set with `textContent` by the scripts, never parsed as HTML, and a
Content-Security-Policy on every response allows scripts only from this origin's /static.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

HERE = Path(__file__).resolve().parent
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")


SECURITY_HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"same-origin"), (b"x-frame-options", b"DENY")]


class SecurityHeaders:
    """Pure ASGI middleware (BaseHTTPMiddleware would get in the way of streamed uploads and
    server-sent events): adds the headers above to every HTTP response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", [])}
                message["headers"] = list(message.get("headers", [])) + [
                    (k, v) for k, v in SECURITY_HEADERS if k not in present]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def mount(app: FastAPI) -> None:
    from service.ui.pages import router

    app.include_router(router)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    app.add_middleware(SecurityHeaders)
