"""Structured logging: ``key=value`` text lines, or one JSON object a line when
``PDSERVE_LOG_FORMAT=json``. Extra fields go in ``extra={"fields": {...}}``."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from pdserve import env

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None)))


class _JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _TextFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = " ".join(f"{k}={v}" for k, v in getattr(record, "fields", {}).items())
        line = f"{ts} {record.levelname.lower():7s} {self.service} {record.getMessage()}"
        line = f"{line} {fields}" if fields else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(service: str) -> None:
    """Configure the root logger once per process (stderr; stdout is for the ready line)."""
    handler = logging.StreamHandler(sys.stderr)
    fmt = env.log_format()
    handler.setFormatter(_JsonFormatter(service) if fmt == "json" else _TextFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(env.log_level().upper())


def fields(**kwargs: Any) -> dict[str, Any]:
    """``log.info("msg", extra=fields(request_id=...))``."""
    return {"fields": kwargs}
