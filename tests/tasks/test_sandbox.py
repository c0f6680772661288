"""The code sandbox: opt-in, honest completion, limits that hold against escapes, cleanup, containment."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

from tadm.tasks import sandbox
from tadm.tasks.benchmarks import Example, get_benchmark, score
from tadm.tasks.sandbox import (NETWORK_ERROR, CodeExecutionNotAllowed, CodeLimits, Containment, SandboxUnavailable,
                                containment, run_program)

LIMITS = CodeLimits(timeout=4, allow_execution=True)
HUMANEVAL = Example("he/0", 'def add(a, b):\n    """Sum."""\n', tests="def check(f):\n    assert f(2, 3) == 5\n",
                    entry_point="add")
FUNCTIONAL = Example("lcb/1", "Add.", tests=[{"input": "2\n3", "output": "5", "testtype": "functional"}],
                     entry_point="add")


@pytest.fixture(autouse=True)
def opted_in(monkeypatch):
    monkeypatch.setenv("TADM_ALLOW_CODE_EXEC", "1")
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)


def _processes_with(text: str) -> list[int]:
    """PIDs whose command line holds ``text`` (namespaced processes are visible from here too)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if text.encode() in handle.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def _still_running(text: str, grace: float = 3.0) -> list[int]:
    """:func:`_processes_with` once the processes sent SIGKILL have had ``grace`` seconds to go: the kernel
    delivers the signal and tears a PID namespace down asynchronously. A sandbox that left them running leaves
    them for days (they sleep that long)."""
    deadline = time.monotonic() + grace
    while (found := _processes_with(text)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


# ------------------------------------------------------------------------------------------- basics
def test_a_correct_program_passes_and_reads_stdin():
    result = run_program("print(sum(map(int, input().split())))", stdin="2 3\n", timeout=5)
    assert result.ok and result.completed and result.stdout == "5\n" and result.returncode == 0
    assert result.stderr == ""  # the sentinel is not shown


def test_a_wrong_program_fails():
    result = run_program("assert 1 + 1 == 3, 'wrong'", timeout=5)
    assert result.status == "error" and "AssertionError" in result.stderr and result.returncode != 0


@pytest.mark.slow
def test_an_infinite_loop_times_out():
    result = run_program("while True:\n    pass\n", timeout=1)
    assert result.status == "timeout" and result.seconds < 3


def test_a_memory_hog_is_stopped():
    result = run_program("block = bytearray(4 * 1024 ** 3)\nprint(len(block))", timeout=5, memory_mb=256)
    assert result.status == "memory" and not result.ok


@pytest.mark.parametrize("code", [
    "import socket\nsocket.create_connection(('127.0.0.1', 9))",
    "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)",
    "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9/', timeout=1)",
])
def test_network_is_disabled(code):
    result = run_program(code, timeout=5)
    assert not result.ok and NETWORK_ERROR in result.stderr


def test_the_evaluating_process_is_untouched():
    result = run_program("import os\nos.environ['TADM_SANDBOX_PROBE'] = '1'\nraise SystemExit(3)", timeout=5)
    assert result.status == "error" and result.returncode == 3 and "TADM_SANDBOX_PROBE" not in os.environ


@pytest.mark.parametrize("timeout", [0, -1, float("nan")])
def test_bad_limits_are_refused(timeout):
    with pytest.raises(ValueError, match="timeout"):
        run_program("pass", timeout=timeout)
    with pytest.raises(ValueError, match="code timeout must be a number of seconds > 0"):
        CodeLimits(timeout=timeout)


# ------------------------------------------------------------------------------------------- opt-in
def test_code_runs_only_after_an_opt_in(monkeypatch):
    monkeypatch.delenv("TADM_ALLOW_CODE_EXEC")
    with pytest.raises(CodeExecutionNotAllowed, match="--allow-code-execution or TADM_ALLOW_CODE_EXEC=1"):
        run_program("print(1)", timeout=5)
    with pytest.raises(CodeExecutionNotAllowed):
        score(get_benchmark("humaneval"), HUMANEVAL, "    return a + b\n")
    assert run_program("print(1)", timeout=5, allow_execution=True).ok
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")  # lm-eval's switch is honoured
    assert run_program("print(1)", timeout=5).ok
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "0")
    monkeypatch.setenv("TADM_ALLOW_CODE_EXEC", "yes")  # only "1" opts in
    with pytest.raises(CodeExecutionNotAllowed):
        run_program("print(1)", timeout=5)


def test_without_a_network_namespace_code_runs_only_when_the_network_is_accepted(monkeypatch):
    level = Containment(namespaces=False, landlock_abi=containment().landlock_abi)
    monkeypatch.setattr(sandbox, "containment", lambda: level)
    with pytest.raises(SandboxUnavailable, match="--allow-code-network"):
        run_program("print(1)", timeout=5)
    result = run_program("print(1)", timeout=5, allow_network=True)
    assert result.ok and "NETWORK OPEN" in result.containment


# ------------------------------------------------------------------------------------ honest scoring
EARLY_EXITS = ["exit(0)", "import os; os._exit(0)", "raise SystemExit(0)", "import sys; sys.exit()",
               "import os, sys; sys.stderr.write(open('/proc/self/cmdline').read()); sys.stderr.flush(); os._exit(0)"]


@pytest.mark.slow
@pytest.mark.parametrize("stop", EARLY_EXITS)
def test_an_early_exit_before_the_humaneval_tests_fails(stop):
    completion = f"    return a + b\n{stop}\n"  # at module level: runs before check(add)
    result = score(get_benchmark("humaneval"), HUMANEVAL, completion, limits=LIMITS)
    assert not result.correct and result.detail == "incomplete"
    assert score(get_benchmark("humaneval"), HUMANEVAL, "    return a + b\n", limits=LIMITS).correct


@pytest.mark.slow
@pytest.mark.parametrize("stop", EARLY_EXITS)
def test_an_early_exit_before_a_functional_livecodebench_test_fails(stop):
    good = "```python\nclass Solution:\n    def add(self, a, b):\n        return a + b\n```"
    assert score(get_benchmark("livecodebench"), FUNCTIONAL, good, limits=LIMITS).correct
    early = good.replace("```python\n", f"```python\n{stop}\n")
    result = score(get_benchmark("livecodebench"), FUNCTIONAL, early, limits=LIMITS)
    assert not result.correct and result.detail == "test 0: incomplete"


def test_a_stdin_program_may_end_with_exit_zero_but_not_skip_the_end():
    assert run_program("print(input())\nexit(0)", stdin="x\n", timeout=5, mode="script").ok
    assert not run_program("print(input())\nexit(0)", stdin="x\n", timeout=5, mode="tests").ok
    result = run_program("import os\nprint(input(), flush=True)\nos._exit(0)", stdin="x\n", timeout=5, mode="script")
    assert result.status == "incomplete"


# ----------------------------------------------------------------------------------- escapes
@pytest.mark.slow
def test_setsid_grandchildren_are_gone_when_score_returns():
    tag = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    completion = textwrap.indent(textwrap.dedent(f"""\
        import subprocess
        for _ in range(20):
            subprocess.Popen(["setsid", "sleep", "{tag}"])
        subprocess.Popen(["setsid", "sh", "-c", "exec 0<&- 1>&- 2>&-; sleep {tag}"])
        while True:
            pass
        """), "    ")
    started = time.monotonic()
    result = score(get_benchmark("humaneval"), HUMANEVAL, completion, limits=CodeLimits(timeout=2, allow_execution=True))
    elapsed = time.monotonic() - started
    assert not result.correct and result.detail == "timeout"
    # a sandbox that waited on the detached grandchildren would take `tag` seconds (days); the margin is for a
    # loaded two-core machine reaping 21 process groups
    assert elapsed < 2 + 5, elapsed
    assert _still_running(f"sleep\x00{tag}") == []


def test_children_that_outlive_a_finished_program_are_killed():
    tag = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    code = f"import subprocess\nsubprocess.Popen(['setsid', 'sh', '-c', 'exec 0<&- 1>&- 2>&-; sleep {tag}'])\nprint('done')"
    started = time.monotonic()
    result = run_program(code, timeout=5)
    assert result.ok and result.stdout == "done\n" and time.monotonic() - started < 3
    assert _still_running(f"sleep\x00{tag}") == []


def test_writes_outside_the_working_directory_are_refused(tmp_path):
    if not containment().filesystem_contained:
        pytest.skip("neither namespaces nor Landlock on this machine (the README says what is not contained)")
    target = tmp_path / "escaped.txt"
    result = run_program(f"open({str(target)!r}, 'w').write('x')\nprint('wrote')", timeout=5)
    assert not result.ok and "wrote" not in result.stdout and not target.exists()
    home = os.path.expanduser("~/.tadm-sandbox-probe")
    result = run_program(f"open({home!r}, 'w').write('x')", timeout=5)
    assert not result.ok and not os.path.exists(home)


SCORER = """
import sys
from tadm.tasks.benchmarks import Example, get_benchmark, score
from tadm.tasks.sandbox import CodeLimits
example = Example("he/0", "def add(a, b):\\n", tests="def check(f):\\n    assert f(2, 3) == 5\\n", entry_point="add")
result = score(get_benchmark("humaneval"), example, sys.argv[1], limits=CodeLimits(timeout=3, allow_execution=True))
print("survived", result.correct, result.detail, flush=True)
"""


@pytest.mark.parametrize("attack", [
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "import os, signal\nos.killpg(0, signal.SIGKILL)",
    "import os, signal\nfor pid in [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
    "    if pid != os.getpid():\n        try:\n            os.kill(pid, signal.SIGKILL)\n        except OSError:\n"
    "            pass\n",
])
@pytest.mark.slow
def test_a_program_that_signals_the_evaluator_does_not_stop_it(attack):
    if not containment().processes_contained and "listdir" in attack:
        pytest.skip("without a PID namespace a program can see (and, without Landlock 6, signal) the evaluator")
    completion = f"    pass\n{attack}\n"  # the attack runs at module level, before check(add)
    env = {**os.environ, "TADM_ALLOW_CODE_EXEC": "1"}
    run = subprocess.run([sys.executable, "-c", SCORER, completion], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0 and "survived False" in run.stdout, (run.stdout, run.stderr[-500:])


@pytest.mark.slow
def test_the_temporary_directory_is_always_removed_and_leftovers_are_swept():
    before = set(os.listdir(tempfile.gettempdir()))
    for code in ("open('x', 'w').write('y')", "import os\nos.makedirs('a/b')\nos.chmod('a', 0)", "while True: pass",
                 "import os; os._exit(0)"):
        run_program(code, timeout=1)
    after = set(os.listdir(tempfile.gettempdir()))
    assert not {n for n in after - before if n.startswith("tadm-sandbox-")}
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs: its evaluator was killed mid-run
    leftover = os.path.join(tempfile.gettempdir(), f"tadm-sandbox-{dead.pid}-left")
    os.makedirs(os.path.join(leftover, "sub"))
    run_program("pass", timeout=5)
    assert not os.path.exists(leftover)


def test_the_raw_socket_module_cannot_reach_the_network_where_namespaces_are_allowed():
    """With a network namespace even ``_socket`` (past the prelude's block) finds no network."""
    if not containment().network_blocked:
        pytest.skip("this machine does not allow an unprivileged network namespace")
    code = "import _socket\ns = _socket.socket()\ns.settimeout(2)\ns.connect(('1.1.1.1', 80))\nprint('connected')"
    result = run_program(code, timeout=10)
    assert not result.ok and "connected" not in result.stdout
    assert "unreachable" in result.stderr.lower() or "errno" in result.stderr.lower()


def test_containment_is_described():
    level = containment()
    text = level.describe()
    assert ("no network" in text) == level.network_blocked
    assert Containment(False, 0).describe() == ("none: NETWORK OPEN, FILE SYSTEM WRITABLE, processes killed by "
                                                "session and marker (best effort)")
