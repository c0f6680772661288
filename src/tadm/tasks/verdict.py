"""Degeneration verdicts: parsing the judge's JSON answer, and the corruption rate over many of them.

The evaluator prompt of the paper's appendix "Generation corruption Evaluation Prompt" asks for
JSON with two independent labels, ``"incoherent"`` and ``"repetition_loop"``, each true, false or
null (null: the judge cannot confidently tell degeneration from valid technical content), plus
``"evidence"`` (supporting excerpts) and ``"brief_reason"``.

:func:`parse_verdict` reads that JSON out of whatever a model answers: inside code fences, among
other text, with single quotes, Python literals (True/None) or trailing commas, and as a last resort
the two labels from a cut-off answer. An answer whose labels cannot be read is a verdict with
``parsed=False``: it is counted as ``unparsed`` by :func:`summarize_verdicts`, never dropped.

Corruption (the paper's metric) = share of parsed verdicts with incoherent or repetition_loop true;
the null share (no label true, at least one null) and the unparsed count are reported beside it.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["LABELS", "Verdict", "VerdictSummary", "parse_verdict", "summarize_verdicts"]

LABELS = ("incoherent", "repetition_loop")
_WORDS = {**dict.fromkeys(("true", "yes", "1"), True), **dict.fromkeys(("false", "no", "0"), False),
          **dict.fromkeys(("null", "none", "unknown", "unsure", "n/a", ""), None)}  # a label's readable words


@dataclass
class Verdict:
    """One judged response: the two labels (True / False / None = null), evidence and reason.

    ``parsed`` is False when the labels could not be read from ``raw`` (then ``error`` says why).
    """

    incoherent: bool | None = None
    repetition_loop: bool | None = None
    evidence: list[str] = field(default_factory=list)
    brief_reason: str = ""
    parsed: bool = False
    raw: str = ""
    error: str | None = None

    @property
    def corrupted(self) -> bool:
        """Flagged incoherent or repetition_loop (the paper's corruption)."""
        return self.parsed and (self.incoherent is True or self.repetition_loop is True)

    @property
    def null(self) -> bool:
        """Parsed, nothing flagged, and at least one label null."""
        return self.parsed and not self.corrupted and (self.incoherent is None or self.repetition_loop is None)

    @property
    def outcome(self) -> str:
        """``"corrupted"``, ``"null"``, ``"clean"`` or ``"unparsed"``."""
        if not self.parsed:
            return "unparsed"
        return "corrupted" if self.corrupted else ("null" if self.null else "clean")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "outcome": self.outcome}


# ------------------------------------------------------------------------------------- parsing
_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*\n?(.*?)```", re.DOTALL)
_TRAILING_COMMA = re.compile(r",\s*([}\]])")
_BARE = {"true": "True", "false": "False", "null": "None"}


def _objects(text: str) -> list[str]:
    """Every balanced ``{...}`` span of ``text`` (outermost first), braces inside quotes ignored."""
    spans, depth, start, quote, escaped = [], 0, -1, "", False
    for i, ch in enumerate(text):
        if quote:
            escaped, quote = (not escaped and ch == "\\"), ("" if ch == quote and not escaped else quote)
            continue
        if ch in "\"'" and depth > 0:
            quote = ch
        elif ch == "{":
            start, depth = (i if depth == 0 else start), depth + 1
        elif ch == "}" and depth > 0:
            depth -= 1
            if depth == 0:
                spans.append(text[start:i + 1])
    return spans


def _python_literal(span: str) -> Any:
    """``span`` read as a Python literal, with bare JSON true/false/null outside strings mapped."""
    pieces = re.split(r"""("(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')""", span)
    for n in range(0, len(pieces), 2):  # even pieces are outside quotes
        pieces[n] = re.sub(r"\b(true|false|null)\b", lambda m: _BARE[m.group(1)], pieces[n])
    return ast.literal_eval("".join(pieces))


def _load(span: str) -> Any:
    for attempt in (span, _TRAILING_COMMA.sub(r"\1", span)):
        try:
            return json.loads(attempt)
        except ValueError:
            pass
        try:
            return _python_literal(attempt)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    return None


def _label(value: Any) -> tuple[bool, bool | None]:
    """(readable, value) of one label: a bool, None, or a word such as "true" / "null"."""
    if value is None or isinstance(value, bool):
        return True, value
    text = str(value).strip().lower()
    return text in _WORDS, _WORDS.get(text)


def _from_mapping(data: dict[str, Any], raw: str) -> Verdict | None:
    data = {re.sub(r"[\s\-]+", "_", str(k).strip().lower()): v for k, v in data.items()}  # "Repetition loop" too
    if not any(label in data for label in LABELS):
        return None
    values: dict[str, bool | None] = {}
    for label in LABELS:
        ok, value = _label(data.get(label)) if label in data else (False, None)
        if not ok:
            return Verdict(raw=raw, error=f"label {label!r} is missing or not true/false/null: {data.get(label)!r}")
        values[label] = value
    evidence = data.get("evidence") or []
    evidence = [str(e) for e in evidence] if isinstance(evidence, (list, tuple)) else [str(evidence)]
    return Verdict(**values, evidence=evidence, brief_reason=str(data.get("brief_reason") or ""), parsed=True, raw=raw)


_LABEL_END = r"""(?=\s*(?:$|\}|,\s*["']|\n))"""  # a label's value ends the text, the object, or is followed by a key


def _from_labels_only(text: str) -> Verdict | None:
    """The two labels of a cut-off object (``{"incoherent": false, "repetition_loop": true, "evid``) or
    of ``key: value`` lines; a value followed by anything else (``true,false``) is not read."""
    values = {}
    for label in LABELS:
        pattern = label.replace("_", r"[_\s-]")
        match = re.search(rf"""["']?{pattern}["']?\s*[:=]\s*["']?(true|false|null|none)["']?{_LABEL_END}""", text,
                          re.IGNORECASE)
        if match is None:
            return None
        values[label] = _label(match.group(1))[1]
    return Verdict(**values, parsed=True, raw=text, error="labels read from an incomplete JSON object")


def parse_verdict(text: str) -> Verdict:
    """The verdict in a judge's answer ``text``; ``parsed=False`` (with ``error``) when it has none."""
    raw = text if isinstance(text, str) else str(text)
    candidates = [m.group(1) for m in _FENCE.finditer(raw)] + [raw]
    broken = None
    for candidate in candidates:
        for span in _objects(candidate):
            data = _load(span)
            verdict = _from_mapping(data, raw) if isinstance(data, dict) else None
            if verdict is not None and verdict.parsed:
                return verdict
            broken = broken or verdict
    fallback = _from_labels_only(raw)
    if fallback is not None:
        return fallback
    return broken or Verdict(raw=raw, error="no JSON object with 'incoherent' and 'repetition_loop' found")


# ------------------------------------------------------------------------------------- summary
@dataclass
class VerdictSummary:
    """Counts and shares over judged responses; shares are of the parsed verdicts."""

    total: int
    parsed: int
    unparsed: int
    corrupted: int
    incoherent: int
    repetition_loop: int
    null: int
    clean: int

    @property
    def corruption(self) -> float:
        """Share of parsed verdicts flagged incoherent or repetition_loop."""
        return self.corrupted / self.parsed if self.parsed else float("nan")

    @property
    def null_share(self) -> float:
        """Share of parsed verdicts with no label true and at least one null."""
        return self.null / self.parsed if self.parsed else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "corruption": self.corruption, "null_share": self.null_share}


def summarize_verdicts(verdicts: Iterable[Verdict]) -> VerdictSummary:
    """Corruption, null and unparsed counts over ``verdicts``."""
    verdicts = list(verdicts)
    parsed = [v for v in verdicts if v.parsed]
    return VerdictSummary(
        total=len(verdicts), parsed=len(parsed), unparsed=len(verdicts) - len(parsed),
        corrupted=sum(v.corrupted for v in parsed), incoherent=sum(v.incoherent is True for v in parsed),
        repetition_loop=sum(v.repetition_loop is True for v in parsed), null=sum(v.null for v in parsed),
        clean=sum(v.outcome == "clean" for v in parsed))
