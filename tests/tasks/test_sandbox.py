"""The code sandbox: opt-in, honest completion, limits that hold against escapes, cleanup, containment.

Levels this machine does not offer are forced (a weaker :class:`Containment` in place of the probed one):
Landlock without namespaces, Landlock below ABI 6 (the same kernel, asked for fewer rights), and neither.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid

import pytest

from tadm.tasks import sandbox
from tadm.tasks.benchmarks import Example, get_benchmark, score
from tadm.tasks.sandbox import (GAPS, MIN_TIMEOUT, NETWORK_ERROR, CodeExecutionNotAllowed, CodeLimits, Containment,
                                SandboxUnavailable, containment, run_program, uncontained_message)

LIMITS = CodeLimits(timeout=4, allow_execution=True)
HUMANEVAL = Example("he/0", 'def add(a, b):\n    """Sum."""\n', tests="def check(f):\n    assert f(2, 3) == 5\n",
                    entry_point="add")
FUNCTIONAL = Example("lcb/1", "Add.", tests=[{"input": "2\n3", "output": "5", "testtype": "functional"}],
                     entry_point="add")


@pytest.fixture(autouse=True)
def opted_in(monkeypatch):
    monkeypatch.setenv("TADM_ALLOW_CODE_EXEC", "1")
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)


LEVELS = ("namespaces", "landlock", "landlock-below-6", "neither")


def forced(name: str) -> Containment:
    """The containment level ``name`` on this machine (the probed one for "namespaces"); skips where it cannot run."""
    real = containment()
    if name == "namespaces":
        if not real.namespaces:
            pytest.skip("this machine does not allow unprivileged namespaces")
        return real
    if name.startswith("landlock"):
        if real.landlock_abi < (6 if name == "landlock" else 1):
            pytest.skip(f"this kernel's Landlock is ABI {real.landlock_abi}")
        return Containment(False, real.landlock_abi if name == "landlock" else min(5, real.landlock_abi), real.seccomp)
    return Containment(False, 0, real.seccomp)


@pytest.fixture(params=LEVELS)
def level(request, monkeypatch):
    """Each containment level in turn, forced where it is weaker than this machine's."""
    chosen = forced(request.param)
    monkeypatch.setattr(sandbox, "containment", lambda: chosen)
    return chosen


def accepting(level: Containment, *, but: str | None = None) -> dict:
    """Keywords that accept every gap of ``level`` (but ``but``): the tests look at what is still contained."""
    return {"allow_uncontained": tuple(g for g in level.gaps() if g != but)}


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


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), 0.001, MIN_TIMEOUT / 2])
def test_bad_limits_are_refused(timeout):
    """A limit under the floor would score the sandbox's start-up (every HumanEval program a time-out)."""
    with pytest.raises(ValueError, match="timeout"):
        run_program("pass", timeout=timeout)
    with pytest.raises(ValueError, match=f"code timeout must be a number of seconds >= {MIN_TIMEOUT:g} "):
        CodeLimits(timeout=timeout)
    assert CodeLimits(timeout=MIN_TIMEOUT).timeout == MIN_TIMEOUT


def test_unknown_gap_names_are_refused():
    with pytest.raises(ValueError, match="unknown sandbox gap 'network-ish'; valid: network, local-sockets"):
        CodeLimits(allow_uncontained=("network-ish",))
    assert CodeLimits(allow_uncontained="signals, file-writes").allow_uncontained == ("signals", "file-writes")


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


def test_each_level_names_exactly_what_it_does_not_contain():
    assert Containment(True, 0, True).gaps() == {} and Containment(False, 6, True).gaps() == {}
    assert list(Containment(False, 5, True).gaps()) == ["signals"]
    assert "except the harness and the evaluator's threads" in Containment(False, 5, True).gaps()["signals"]
    neither = Containment(False, 0, True).gaps()
    assert list(neither) == ["file-writes", "process-files", "signals"]
    assert "write wherever the user can" in neither["file-writes"] and "/proc/<pid>/mem" in neither["file-writes"]
    assert "environments (tokens included)" in neither["process-files"] and "evaluator" in neither["process-files"]
    nothing = Containment(False, 0, False).gaps()
    assert list(nothing) == list(GAPS)
    assert "the evaluator included" in nothing["signals"] and "abstract sockets" in nothing["local-sockets"]
    assert "socket files (" in Containment(True, 7, False).gaps()["local-sockets"]  # abstract ones are per netns
    assert list(Containment(True, 7, False).gaps()) == ["local-sockets"]


@pytest.mark.parametrize("weak", [Containment(False, 5, True), Containment(False, 0, True),
                                  Containment(False, 0, False)], ids=["landlock-below-6", "neither", "nothing"])
def test_a_level_with_gaps_runs_code_only_when_the_user_accepts_each_one(monkeypatch, weak):
    monkeypatch.setattr(sandbox, "containment", lambda: weak)
    gaps = list(weak.gaps())
    with pytest.raises(SandboxUnavailable) as refused:
        run_program("print(1)", timeout=5, allow_uncontained=gaps[1:])  # one short
    message = str(refused.value)
    assert "\n" not in message and f"({weak.name}) does not contain {gaps[0]} (" in message
    assert message.endswith(f"or accept this with --allow-uncontained-code {gaps[0]}")
    with pytest.raises(SandboxUnavailable, match=f"--allow-uncontained-code {','.join(gaps)}$"):
        run_program("print(1)", timeout=5)
    result = run_program("print(1)", timeout=5, allow_uncontained=gaps)
    assert result.ok and result.containment == weak.describe()
    assert "NOT CONTAINED: " + ", ".join(gaps) in result.containment
    assert uncontained_message(weak, GAPS) is None


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
def test_setsid_grandchildren_are_gone_when_score_returns(level):
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
    result = score(get_benchmark("humaneval"), HUMANEVAL, completion,
                   limits=CodeLimits(timeout=2, allow_execution=True, **accepting(level)))
    elapsed = time.monotonic() - started
    assert not result.correct and result.detail == "timeout"
    # a sandbox that waited on the detached grandchildren would take `tag` seconds (days); the margin is for a
    # loaded two-core machine reaping 21 process groups
    assert elapsed < 2 + 5, elapsed
    assert _still_running(f"sleep\x00{tag}") == []


def test_children_that_outlive_a_finished_program_are_killed(level):
    """A ``setsid`` grandchild (of a forked child that exited: an orphan) is gone when the run returns, at every
    level: the harness is its reaper and kills every descendant."""
    tag = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    code = ("import os, subprocess\nif os.fork() == 0:\n    subprocess.Popen(['setsid', 'sh', '-c', "
            f"'exec 0<&- 1>&- 2>&-; sleep {tag}'], start_new_session=True)\n    os._exit(0)\nos.wait()\nprint('done')")
    started = time.monotonic()
    result = run_program(code, timeout=5, **accepting(level))
    assert result.ok and result.stdout == "done\n" and time.monotonic() - started < 4, result.stderr[-300:]
    assert _still_running(f"sleep\x00{tag}") == []


def test_writes_outside_the_working_directory_are_refused(tmp_path, level):
    if "file-writes" in level.gaps():
        pytest.skip("this level does not contain writes (it says so: file-writes)")
    target = tmp_path / "escaped.txt"
    result = run_program(f"open({str(target)!r}, 'w').write('x')\nprint('wrote')", timeout=5, **accepting(level))
    assert not result.ok and "wrote" not in result.stdout and not target.exists()
    home = os.path.expanduser("~/.tadm-sandbox-probe")
    result = run_program(f"open({home!r}, 'w').write('x')", timeout=5, **accepting(level))
    assert not result.ok and not os.path.exists(home)


def test_a_correct_program_that_writes_by_relative_path_is_scored_correct(level):
    """The working directory is the program's writable one (in a mount namespace: the bind mount, not the
    read-only directory under it)."""
    completion = ("    with open('scratch.txt', 'w') as f:\n        f.write(str(a + b))\n"
                  "    with open('scratch.txt') as f:\n        return int(f.read())\n")
    result = score(get_benchmark("humaneval"), HUMANEVAL, completion,
                   limits=CodeLimits(timeout=5, allow_execution=True, **accepting(level)))
    assert result.correct, result.detail
    made = run_program("import os\nos.makedirs('a/b')\nopen('a/b/c', 'w').write('x')\nprint(sorted(os.listdir('.')))",
                       timeout=5, **accepting(level))
    assert made.ok and made.stdout == "['a', 'program.py']\n", (made.stdout, made.stderr[-300:])


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
    if not containment().namespaces and "listdir" in attack:
        pytest.skip("without a PID namespace a program sees every process (the forced levels' test covers signals)")
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
    if not containment().namespaces:
        pytest.skip("this machine does not allow an unprivileged network namespace")
    code = "import _socket\ns = _socket.socket()\ns.settimeout(2)\ns.connect(('1.1.1.1', 80))\nprint('connected')"
    result = run_program(code, timeout=10)
    assert not result.ok and "connected" not in result.stdout
    assert "unreachable" in result.stderr.lower() or "errno" in result.stderr.lower()


def test_containment_is_described():
    level = containment()
    assert level.describe().startswith(level.name + ": ")
    assert ("NOT CONTAINED" in level.describe()) == bool(level.gaps())
    assert Containment(True, 7, True).describe() == (
        "namespaces+landlock-abi7+seccomp: network, local-sockets, file-writes, process-files, signals, "
        "leftover-processes contained; file reads not contained")
    assert Containment(False, 0, True).describe() == (
        "seccomp: network, local-sockets, leftover-processes contained; NOT CONTAINED: file-writes, process-files, "
        "signals, file reads")
    assert Containment(False, 0, False).describe() == (
        "none: nothing contained; NOT CONTAINED: network, local-sockets, file-writes, process-files, signals, "
        "leftover-processes, file reads")


# ------------------------------------------------------------------------------- local listeners
@contextlib.contextmanager
def _listeners():
    """Real listeners that record what reaches them: Unix stream and datagram sockets on files and on abstract
    names, and a UDP socket on the loopback."""
    folder = tempfile.mkdtemp(prefix="tadm-l-", dir="/tmp")  # short: a socket path holds at most 107 bytes
    tag = uuid.uuid4().hex[:12]
    addresses = {"stream-file": os.path.join(folder, "s"), "stream-abstract": f"\0tadm-test-s-{tag}",
                 "dgram-file": os.path.join(folder, "d"), "dgram-abstract": f"\0tadm-test-d-{tag}"}
    sockets, received, stop = {}, [], threading.Event()
    for name, address in addresses.items():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM if name.startswith("stream") else socket.SOCK_DGRAM)
        sock.bind(address)
        if name.startswith("stream"):
            sock.listen(8)
        sockets[name] = sock
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    sockets["udp"] = udp

    def serve() -> None:
        open_ = dict(sockets)
        while not stop.is_set():
            for sock in select.select(list(open_.values()), [], [], 0.05)[0]:
                name = next(n for n, s in open_.items() if s is sock)
                if name.startswith("stream-") and "+" not in name:
                    connection, _ = sock.accept()
                    received.append(f"{name}: connection")
                    open_[f"{name}+{len(open_)}"] = connection
                else:
                    data = sock.recv(4096)
                    if data:
                        received.append(f"{name}: {data!r}")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield {**addresses, "udp": udp.getsockname()[1]}, received
    finally:
        time.sleep(0.2)  # what was sent before the program ended has arrived
        stop.set()
        thread.join(5)
        for sock in sockets.values():
            sock.close()
        shutil.rmtree(folder, ignore_errors=True)


def _socket_attempts(addresses: dict) -> str:
    """A program that tries every way to a Unix listener and a UDP one: Python's ``_socket`` (below the prelude's
    block), a datagram socket pair (already created, then pointed at an address), and libc's calls through ctypes."""
    return textwrap.dedent(f"""\
        import _socket, ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        addresses = {json.dumps(addresses)}
        def stream(address):
            s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            s.connect(address)
            s.sendall(b"hello")
        def dgram(address):
            _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM).sendto(b"hello", address)
        def pair(address):
            _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_DGRAM)[0].sendto(b"hello", address)
        def stream_pair(address):
            _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)[0].sendto(b"hello", address)
        def libc_connect(address):
            fd = libc.socket(1, 1, 0)
            raw = address.encode()
            where = ctypes.create_string_buffer(b"\\x01\\x00" + raw, 2 + len(raw) + 1)
            if fd < 0 or libc.connect(fd, where, 2 + len(raw) + (0 if raw.startswith(b"\\0") else 1)) != 0:
                raise OSError(ctypes.get_errno(), "libc")
            libc.send(fd, b"hello", 5, 0)
        def udp(port):
            _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM).sendto(b"hello", ("127.0.0.1", port))
        tries = [(stream, "stream-file"), (stream, "stream-abstract"), (libc_connect, "stream-file"),
                 (libc_connect, "stream-abstract"), (dgram, "dgram-file"), (dgram, "dgram-abstract"),
                 (pair, "dgram-file"), (pair, "dgram-abstract"), (stream_pair, "dgram-file"), (udp, "udp")]
        for attempt, name in tries:
            try:
                attempt(addresses[name])
                print(attempt.__name__, name, "REACHED")
            except OSError as err:
                print(attempt.__name__, name, "refused", err.errno)
        """)


def test_no_local_listener_or_udp_socket_is_reachable(level):
    """Unix socket files and abstract names on the host (a Docker or ssh-agent socket, D-Bus) and UDP: a real
    listener, served by a thread here, receives nothing at any level that runs code without the gap."""
    if "local-sockets" in level.gaps():
        pytest.skip("this level does not contain local sockets (it says so: local-sockets)")
    with _listeners() as (addresses, received):
        result = run_program(_socket_attempts(addresses), timeout=10, **accepting(level))
    assert result.ok, result.stderr[-500:]
    assert "REACHED" not in result.stdout and result.stdout.count("refused") == 10, result.stdout
    assert received == []


def test_the_listeners_are_real_without_the_filter(monkeypatch):
    """The same program, on a level without seccomp and namespaces, reaches every listener: the test above would
    fail on a sandbox that let one through."""
    real = containment()
    if real.landlock_abi < 6 or not real.seccomp:
        pytest.skip("needs Landlock ABI 6 here (its abstract-socket scope is then the only thing left)")
    weak = Containment(False, real.landlock_abi, False)  # Landlock 6 scopes abstract sockets; files stay open
    monkeypatch.setattr(sandbox, "containment", lambda: weak)
    with _listeners() as (addresses, received):
        result = run_program(_socket_attempts(addresses), timeout=10, **accepting(weak))
    assert "stream stream-file REACHED" in result.stdout and "udp udp REACHED" in result.stdout
    assert "stream-file: connection" in received and "udp: b'hello'" in received
    assert "stream stream-abstract refused" in result.stdout  # Landlock's scope holds this one


# ------------------------------------------------------------------------------- the evaluator's environment
def test_no_variable_of_the_evaluator_reaches_the_program(level, monkeypatch):
    """Neither the program's environment nor its parent's (the harness's) nor, where the level contains process
    files, the evaluator's /proc/<pid>/environ holds the evaluator's variables."""
    secret = f"hf_{uuid.uuid4().hex}"
    monkeypatch.setenv("HF_TOKEN", secret)
    code = textwrap.dedent(f"""\
        import os
        seen = {{"environ": any({secret!r} in v for v in os.environ.values())}}
        for who, pid in (("parent", os.getppid()), ("evaluator", {os.getpid()})):
            try:
                with open(f"/proc/{{pid}}/environ", "rb") as handle:
                    seen[who] = {secret!r}.encode() in handle.read()
            except OSError:
                seen[who] = "unreadable"
        print(seen)
        """)
    result = run_program(code, timeout=5, **accepting(level))
    assert result.ok, result.stderr[-300:]
    seen = eval(result.stdout)  # noqa: S307 (our own program's printed dict)
    assert seen["environ"] is False and seen["parent"] in (False, "unreadable")
    monkeypatch.setenv("PATH", "/evaluator-only-bin:" + os.environ.get("PATH", ""))
    code = "import os; print(sorted(os.environ), os.environ['PATH'])"
    names = run_program(code, timeout=5, **accepting(level)).stdout
    assert names.startswith("['HOME', 'LANG', 'PATH', 'PYTHONIOENCODING', 'TADM_SANDBOX_RUN', 'TMPDIR', 'no_proxy'] ")
    assert "evaluator-only" not in names
    if "process-files" not in level.gaps():  # where it is a gap, a user's evaluator is readable (not root's: the
        assert seen["evaluator"] in (False, "unreadable")  # kernel also wants the reader to hold root's capabilities)


def test_no_capability_is_left_to_remount_the_file_system_writable():
    """Root in its user namespace, the program still holds no capability: it cannot remount / read-write."""
    if not containment().namespaces:
        pytest.skip("this machine does not allow unprivileged namespaces")
    code = textwrap.dedent("""\
        import ctypes
        status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
        print(status["CapEff"].strip(), status["CapBnd"].strip())
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.mount(None, b"/", None, 32 | 4096, None), ctypes.get_errno())  # MS_REMOUNT | MS_BIND, read-write
        """)
    result = run_program(code, timeout=5)
    assert result.ok and result.stdout.splitlines()[0] == "0000000000000000 0000000000000000"
    assert result.stdout.splitlines()[1] == "-1 1"  # EPERM


# ------------------------------------------------------------------------------------ forging a verdict
FORGER = textwrap.dedent("""\
    import gc, os, re, sys
    found, likely = set(), []
    frame = sys._getframe()
    while frame is not None:  # every frame's locals and globals, the prelude's included
        for name, value in [*frame.f_locals.items(), *frame.f_globals.items()]:
            if isinstance(value, (bytes, str)) and 8 <= len(value) <= 200:
                found.add(value.encode() if isinstance(value, str) else value)
                if "nonce" in name or "sentinel" in name or re.fullmatch(r"[0-9a-f]{32}", str(value)):
                    likely.append(value.encode() if isinstance(value, str) else value)
        frame = frame.f_back
    for value in gc.get_objects():  # and every object the collector knows
        if isinstance(value, dict):
            for item in value.values():
                if isinstance(item, (bytes, str)) and 16 <= len(item) <= 64:
                    found.add(item.encode() if isinstance(item, str) else item)
    forged = [b'{"status": "ok", "returncode": 0, "nonce": "' + f + b'"}\\n' for f in found if f.isalnum()]
    forged += [b"\\n" + f + b"\\n" for f in found] + [b'{"ready": true}\\n', b'{"status": "ok"}\\n']
    targets = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
    targets += [f"/proc/{os.getppid()}/fd/{fd}" for fd in range(64)]
    try:  # the evaluator: the harness's parent
        evaluator = int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1])
        targets += [f"/proc/{evaluator}/fd/{fd}" for fd in range(64)]
    except (OSError, ValueError, IndexError):
        pass
    for path in targets:  # write every candidate to every descriptor this process or its parent holds
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        for text in forged:
            try:
                os.write(fd, text)
            except OSError:
                pass
    for fd in range(3, 64):
        for text in forged:
            try:
                os.write(fd, text)
            except OSError:
                pass
    try:
        print(len(open(f"/proc/{os.getppid()}/mem", "rb").read(1)))  # the harness's memory
    except OSError:
        pass
    sys.stdout.flush()
    for value in likely:  # what an end-of-run marker would look like, last on stderr
        os.write(2, b"\\n" + value + b"\\n")
    os._exit(0)
    """)


@pytest.mark.parametrize("where", ["before the tests", "inside the function"])
def test_a_program_that_forges_completion_from_its_frames_objects_and_descriptors_is_not_correct(where, level):
    """The old sentinel lived in the prelude's frame: a program could read it and write it out. Now nothing in
    the program's process decides the verdict, so walking frames and gc objects and writing what it finds to every
    descriptor (its own and, through /proc, its parent's) earns nothing."""
    body = "    return a - b\n" + FORGER if where == "before the tests" else (
        "    " + FORGER.replace("\n", "\n    ").rstrip() + "\n")
    result = score(get_benchmark("humaneval"), HUMANEVAL, body,
                   limits=CodeLimits(timeout=10, allow_execution=True, **accepting(level)))
    assert not result.correct and result.detail in ("incomplete", "error"), result.detail  # error: junk on its pipe


def test_an_object_equal_to_everything_does_not_pass_a_check():
    """Results cross to the checks as plain data: an ``__eq__`` that always holds stays in the program."""
    completion = "    class Same:\n        def __eq__(self, other):\n            return True\n    return Same()\n"
    result = score(get_benchmark("humaneval"), HUMANEVAL, completion, limits=LIMITS)
    assert not result.correct and result.detail == "error"
    subclass = "    class Two(int):\n        def __eq__(self, other):\n            return True\n    return Two(4)\n"
    assert not score(get_benchmark("humaneval"), HUMANEVAL, subclass, limits=LIMITS).correct  # crosses as 4


def test_values_cross_between_program_and_checks_unchanged():
    code = "def echo(*args, **kwargs):\n    return [args, kwargs]\n"
    values = ('[None, True, 0, -(10 ** 5000), 2.5, -0.0, float("inf"), 1 + 2j, "é\\ud800", b"\\x00\\xff", '
              'bytearray(b"ab"), [1, [2]], (1, (2,)), {1: "a", (2, 3): None}, {1, 2}, frozenset({3})]')
    checks = (f"values = {values}\n"
              "got = program.function('echo')(*values, key=values)\n"
              "assert got == [tuple(values), {'key': values}], got\n"
              "assert [type(v) for v in got[0]] == [type(v) for v in values]\n"
              "assert str(got[0][5]) == '-0.0'\n")
    result = run_program(code, checks=checks, timeout=10)
    assert result.ok, result.stderr[-500:]


# ------------------------------------------------------------------------------------------- signals
SIGNALLER = """
import json, os, sys
from tadm.tasks import sandbox
from tadm.tasks.benchmarks import Example, get_benchmark, score
from tadm.tasks.sandbox import CodeLimits, Containment
level = Containment(**json.loads(sys.argv[2]))
sandbox.containment = lambda: level
example = Example("he/0", "def add(a, b):\\n", tests="def check(f):\\n    assert f(2, 3) == 5\\n", entry_point="add")
result = score(get_benchmark("humaneval"), example, sys.argv[1].replace("EVALUATOR", str(os.getpid())),
               limits=CodeLimits(timeout=3, allow_execution=True, allow_uncontained=tuple(level.gaps())))
print("survived", result.correct, result.detail, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("attack", [
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "import os, signal\nos.kill(EVALUATOR, signal.SIGKILL)",
    "import os, signal\nfor tid in os.listdir('/proc/EVALUATOR/task'):\n    os.kill(int(tid), signal.SIGKILL)",
    "import os, signal\nos.killpg(os.getpgid(EVALUATOR), signal.SIGKILL)",
], ids=["harness", "evaluator", "evaluator-threads", "evaluator-group"])
def test_a_program_cannot_signal_the_harness_or_the_evaluator_at_any_level(attack, level):
    """Targeted signals only (the forced levels share this machine's processes, so nothing goes to -1); the
    evaluator runs in a session of its own, so a sandbox that let its group's signal through kills only it."""
    env = {**os.environ, "TADM_ALLOW_CODE_EXEC": "1"}
    run = subprocess.run([sys.executable, "-c", SIGNALLER, f"    pass\n{attack}\n", json.dumps(level.__dict__)],
                         capture_output=True, text=True, timeout=60, env=env, start_new_session=True)
    assert run.returncode == 0 and "survived False" in run.stdout, (run.stdout, run.stderr[-500:])


def test_the_filter_refuses_signals_to_every_process_and_to_the_protected_ones(level):
    """Signal 0 (a permission check that sends nothing): refused for -1, the harness and the evaluator."""
    if not level.seccomp and not level.namespaces:
        pytest.skip("no seccomp filter at this level")
    code = textwrap.dedent(f"""\
        import os
        for name, pid in (("all", -1), ("harness", os.getppid()), ("evaluator", {os.getpid()}), ("self", os.getpid())):
            try:
                os.kill(pid, 0)
                print(name, "allowed")
            except OSError as err:
                print(name, err.errno)
        """)
    result = run_program(code, timeout=5, **accepting(level))
    lines = dict(line.split() for line in result.stdout.splitlines())
    assert lines["all"] == "1" and lines["harness"] == "1" and lines["self"] == "allowed", result.stdout
    assert lines["evaluator"] in ("1", "3")  # EPERM, or ESRCH where a PID namespace hides it
