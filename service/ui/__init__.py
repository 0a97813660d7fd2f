"""The web UI, served by the API process: server-rendered pages (Jinja2, autoescaped) with a
little JavaScript (live updates from the server-sent events, lazy turns, keyboard navigation,
charts with the vendored Chart.js). Everything agents and tasks wrote is untrusted text: it is
escaped by the templates or set with `textContent` by the scripts, never parsed as HTML, and a
Content-Security-Policy on every response allows scripts only from this origin's /static.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.staticfiles import StaticFiles

HERE = Path(__file__).resolve().parent
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")


def mount(app: FastAPI) -> None:
    from service.ui.pages import router

    app.include_router(router)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.middleware("http")
    async def security_headers(request: Request, call_next):
        response = await call_next(request)
        response.headers.setdefault("Content-Security-Policy", CSP)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "same-origin")
        response.headers.setdefault("X-Frame-Options", "DENY")
        return response
