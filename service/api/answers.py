"""Who may see the hidden answers (service.control.redaction): a caller with the API token, or
the web UI with the HttpOnly cookie set by `remember`, which shows answers but never authorizes
a change."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Annotated

from fastapi import Depends, Request, Response

from service.api.deps import has_token
from service.control.redaction import Answers

COOKIE = "swerve_answers"


def cookie_value(token: str) -> str:
    """The UI cookie holds this, not the token: a stolen cookie reads answers but changes nothing."""
    return hmac.new(token.encode(), b"swerve: show answers in the web UI", hashlib.sha256).hexdigest()


def answers(request: Request) -> Answers:
    settings = request.app.state.settings
    cookie = request.cookies.get(COOKIE)
    by_cookie = settings.api_token is not None and cookie is not None and secrets.compare_digest(
        cookie.encode(), cookie_value(settings.api_token).encode())
    return Answers(shown=has_token(request, settings) or by_cookie)


def remember(request: Request, response: Response, token: str) -> None:
    """Set the UI cookie for a right token; forget it for any other (an empty one logs out)."""
    expected = request.app.state.settings.api_token
    if expected is not None and secrets.compare_digest(token.encode(), expected.encode()):
        response.set_cookie(COOKIE, cookie_value(expected), httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
    else:
        response.delete_cookie(COOKIE, httponly=True, samesite="strict")


AnswersDep = Annotated[Answers, Depends(answers)]
