"""Logging setup: plain text for people, JSON lines in containers."""

from __future__ import annotations

import json
import logging

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": self.formatTime(record), "level": record.levelname,
               "logger": record.name, "msg": record.getMessage()}
        out |= {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(fmt: str = "text", level: int | str = logging.INFO, path=None) -> None:
    """Log to stderr, or to the file `path` (appended)."""
    handler = logging.StreamHandler() if path is None else logging.FileHandler(path)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
