"""Logging set-up: plain text for people, JSON lines for machines (``INFERSCALE_LOG_FORMAT``)."""

from __future__ import annotations

import json
import logging
import time

_CONTEXT_FIELDS = ("user_id", "conversation_id", "turn_id", "topic", "partition", "offset",
                   "fact_ids", "reencoded_ids", "reason")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with InferScale context fields passed via ``extra``."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                 + f".{int(record.msecs):03d}Z", "level": record.levelname,
                 "logger": record.name, "msg": record.getMessage()}
        entry.update({k: getattr(record, k) for k in _CONTEXT_FIELDS if hasattr(record, k)})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(fmt: str = "text", level: int = logging.INFO) -> None:
    """Install one stderr handler in the chosen format; quiet the chatty libraries."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("aiokafka", "httpx", "sentence_transformers", "alembic", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
