"""Log format of every pdserve process (workers, their ranks, the router). Torch-free."""

from __future__ import annotations

import logging
import os


def configure_logging(role: str) -> None:
    """Structured-enough logs on stderr: time, level, role, TP rank (0: the worker process
    is its group's leader; follower ranks are spawned processes), pid, logger, request id
    (when a record carries one), message."""
    class _Fields(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.role = role
            record.rank = getattr(record, "rank", 0)  # this process is its group's rank 0
            record.rid = getattr(record, "request_id", "-")
            return True

    handler = logging.StreamHandler()
    handler.addFilter(_Fields())
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(levelname)s role=%(role)s rank=%(rank)s pid=%(process)d %(name)s "
        "request_id=%(rid)s %(message)s"))
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"), handlers=[handler])
