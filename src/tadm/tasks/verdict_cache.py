"""On-disk cache of judge answers, so an interrupted judging run resumes without asking again.

One JSON line per answer in ``DIR/verdicts.jsonl``, keyed by the SHA-256 of (judge id, prompt,
response). The raw answer is stored, not the parsed verdict, so a better parser applies to cached
answers too. Lines are appended and flushed one at a time; a last line cut short by an interrupted
write is skipped on load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

__all__ = ["CACHE_FILENAME", "VerdictCache", "verdict_key"]

CACHE_FILENAME = "verdicts.jsonl"
log = logging.getLogger(__name__)


def verdict_key(judge_id: str, prompt: str, response: str) -> str:
    """SHA-256 (hex) of the judge's id, the prompt and the response."""
    payload = json.dumps([judge_id, prompt, response], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class VerdictCache:
    """Raw judge answers by :func:`verdict_key`, loaded from and appended to ``directory/verdicts.jsonl``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory).expanduser() / CACHE_FILENAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._answers: dict[str, str] = {}
        self._lock = threading.Lock()
        self._load()

    def _load(self) -> None:
        if not self.path.is_file():
            return
        with self.path.open("rb+") as raw:  # end a line cut short so that appends start on a new one
            raw.seek(0, os.SEEK_END)
            if raw.tell() > 0:
                raw.seek(-1, os.SEEK_END)
                if raw.read(1) != b"\n":
                    raw.write(b"\n")
        with self.path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                try:
                    record = json.loads(line)
                    self._answers[str(record["key"])] = str(record["raw"])
                except (ValueError, KeyError, TypeError):
                    log.warning("%s:%d: skipping an unreadable cache line", self.path, number)

    def get(self, key: str) -> str | None:
        """The cached raw answer for ``key``, or None."""
        return self._answers.get(key)

    def put(self, key: str, raw: str, judge_id: str = "") -> None:
        """Store ``raw`` under ``key`` and append it to the file at once."""
        line = json.dumps({"key": key, "judge": judge_id, "raw": raw}, ensure_ascii=False) + "\n"
        with self._lock:
            self._answers[key] = raw
            with self.path.open("a", encoding="utf-8") as out:
                out.write(line)
                out.flush()
