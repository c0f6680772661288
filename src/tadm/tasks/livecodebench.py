"""LiveCodeBench: its released rows as tadm records, and the programs that check a solution.

The dataset (``livecodebench/code_generation_lite`` on the Hub) is a set of JSONL files, one per
release window (``test.jsonl`` ... ``test6.jsonl``; v6 is ``test6.jsonl``). A row has
``question_title``, ``question_content``, ``starter_code``, ``platform``, ``contest_date``,
``public_test_cases`` (a JSON list of ``{"input", "output", "testtype"}``), ``private_test_cases``
(the same list, as JSON or as base64 of zlib-compressed pickled JSON) and ``metadata`` (JSON; LeetCode
problems name their method in ``func_name``).

* :func:`decode_test_cases` reads either form. The pickle holds one string; it is loaded with an
  unpickler that refuses every global (class, function), so a file cannot run code through it.
* :func:`record_from_row` turns a row into the ``livecodebench`` record of ``tadm eval tasks``:
  ``question``, ``tests`` (public then private), ``starter_code``, ``func_name``, ``id``, ``date``.
* :func:`convert_rows` filters rows by contest date; ``tadm eval convert-livecodebench`` writes them.

Two kinds of test (``testtype``):

* ``stdin``: the program reads the input on standard input; its standard output must equal the
  expected output line by line (trailing spaces ignored);
* ``functional`` (LeetCode): the solution defines ``class Solution`` with method ``func_name``; the
  input holds one JSON value per line (the arguments) and the output one JSON value (the result).
  :func:`functional_program` puts the usual imports before the solution, and :func:`functional_checks`
  (run in the sandbox's harness, not in the program) calls the method on a fresh ``Solution()`` and
  prints ``json.dumps`` of the result, which is compared to the expected value as JSON.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import zlib
from collections.abc import Iterable
from typing import Any

from tadm.records import read_json_lines

__all__ = ["convert_rows", "decode_test_cases", "functional_checks", "functional_program", "read_raw_jsonl",
           "record_from_row", "same_json_output"]


class _NoGlobals(pickle.Unpickler):
    """Unpickles plain data only (strings, numbers, lists, dicts): every global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name}: LiveCodeBench test files hold plain data only")


def decode_test_cases(value: Any) -> list[dict[str, Any]]:
    """A test-case list from a row field: a list, a JSON string, or base64(zlib(pickle(JSON string)))."""
    if isinstance(value, list):
        return value
    if not isinstance(value, str):
        raise ValueError(f"test cases must be a list or a string, got {type(value).__name__}")
    text = value.strip()
    if not text:
        return []
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        data = _NoGlobals(io.BytesIO(zlib.decompress(base64.b64decode(text)))).load()
    except (ValueError, zlib.error, pickle.UnpicklingError, EOFError) as err:
        raise ValueError(f"test cases are neither JSON nor compressed JSON ({err})") from None
    return json.loads(data) if isinstance(data, (str, bytes)) else data


def _metadata(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value) if value else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


ROW_FIELDS = ("question_content", "public_test_cases", "contest_date")  # what every released row has


def record_from_row(row: dict[str, Any]) -> dict[str, Any]:
    """The ``livecodebench`` record of a released row (see the module docstring); a ValueError when the row
    lacks LiveCodeBench's fields or test cases."""
    if not isinstance(row, dict):
        raise ValueError(f"a row is a JSON object, got {type(row).__name__}")
    missing = [name for name in ROW_FIELDS if name not in row]
    if missing:
        raise ValueError(f"not a LiveCodeBench problem: no {', '.join(missing)}")
    tests = decode_test_cases(row.get("public_test_cases", [])) + decode_test_cases(row.get("private_test_cases", []))
    if not tests or not all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
        raise ValueError("no test cases, or a test case without 'input' and 'output'")
    title, content = str(row.get("question_title", "") or ""), str(row.get("question_content", "") or "")
    question = f"{title}\n\n{content}".strip() if title and not content.startswith(title) else content
    return {"id": str(row.get("question_id", "")), "question": question,
            "tests": [{"input": t["input"], "output": t["output"], "testtype": t.get("testtype", "stdin")}
                      for t in tests],
            "starter_code": str(row.get("starter_code", "") or ""),
            "func_name": str(_metadata(row.get("metadata")).get("func_name", "") or ""),
            "date": str(row.get("contest_date", "") or "")[:10], "platform": str(row.get("platform", "") or "")}


def read_raw_jsonl(path: str) -> list[dict[str, Any]]:
    """The rows of a released LiveCodeBench JSONL file; a malformed line is an error naming it."""
    return [row for _, row in read_json_lines(path)]


def convert_rows(rows: Iterable[dict[str, Any]], *, since: str | None = None,
                 until: str | None = None) -> list[dict[str, Any]]:
    """Records of the rows whose contest date (``YYYY-MM-DD``) is in [since, until], in order; a ValueError
    names the first row (from 1) that is not a LiveCodeBench problem."""
    records = []
    for n, row in enumerate(rows, 1):
        try:
            records.append(record_from_row(row))
        except ValueError as err:
            name = f" ({row['question_id']})" if isinstance(row, dict) and row.get("question_id") else ""
            raise ValueError(f"row {n}{name}: {err}") from None
    return [r for r in records if (since is None or r["date"] >= since) and (until is None or r["date"] <= until)]


_CALL = """import json
arguments = [json.loads(line) for line in {input!r}.split("\\n") if line.strip()]
print(json.dumps(program.method("Solution", {name!r})(*arguments)))
"""


def functional_program(code: str, func_name: str) -> str:
    """``code`` (which defines ``class Solution``) after the imports LeetCode solutions take for granted."""
    if not func_name:
        raise ValueError("a functional LiveCodeBench test needs the method's name (func_name)")
    header = "from typing import *\nfrom collections import *\nimport math, heapq, bisect, itertools, functools\n"
    return header + code + "\n"


def functional_checks(func_name: str, arguments: str) -> str:
    """The harness's side of a functional test: ``Solution().func_name`` on the JSON values of ``arguments``
    (one a line), its result printed as JSON."""
    if not func_name:
        raise ValueError("a functional LiveCodeBench test needs the method's name (func_name)")
    return _CALL.format(input=arguments, name=func_name)


def same_json_output(actual: str, expected: str) -> bool:
    """A functional test's printed result equals the expected JSON value (text equality if not JSON)."""
    try:
        return json.loads(actual.strip()) == json.loads(expected.strip())
    except ValueError:
        return actual.strip() == expected.strip()
