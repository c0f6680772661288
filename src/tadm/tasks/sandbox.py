"""Running model-written code (HumanEval, LiveCodeBench) in a sandbox that enforces its limits.

Code a model wrote is untrusted. :func:`run_program` runs it only after an explicit opt-in
(:func:`code_execution_allowed`: ``--allow-code-execution``, ``TADM_ALLOW_CODE_EXEC=1``, or lm-eval's
``HF_ALLOW_CODE_EVAL=1``), in a fresh temporary directory, with ``sys.executable -I -B``, and with
every containment this machine offers (:func:`containment` probes them once):

* **Linux namespaces** (``unshare``; no root needed where unprivileged user namespaces are allowed):
  a network namespace with no interfaces (no network at all, raw sockets included), a PID namespace
  (the program sees only its own processes, cannot signal the evaluator, and *every* descendant,
  ``setsid`` ones included, dies with the namespace), and a mount namespace in which every mount is
  remounted read-only except the temporary directory, so writes anywhere else fail;
* **Landlock** (Linux >= 5.13, also without namespaces): writes refused outside the temporary
  directory (and ``/dev/null``); from ABI 4 TCP connect/bind refused; from ABI 6 no signal can reach
  a process outside the sandbox.

Always: a wall-clock time limit after which everything the program started is killed (the PID
namespace, or its session plus every process carrying the run's marker in its environment), reading
its output never waits past that deadline, a CPU-time limit (``RLIMIT_CPU``), an address-space limit
(``RLIMIT_AS``), a minimal environment, a socket block in the prelude as a last line, and removal of
the temporary directory (a directory left by an evaluator that was killed is removed by the next run).

Where there is no network namespace, the network cannot be fully blocked (Landlock does not cover
UDP or raw sockets), so code runs there only with ``allow_network=True`` (``--allow-code-network``).

**Honest scoring.** A run counts as complete only if the program ran to its end: after it returns,
the prelude writes a random per-run sentinel (read from a pipe that is closed before the program
starts) to standard error. ``exit(0)``, ``os._exit(0)``, ``raise SystemExit(0)`` or a killed
process leave no sentinel, and :attr:`SandboxResult.ok` is False. In ``"script"`` mode (stdin
programs) ``SystemExit`` with status 0 is a normal end, as on a judge. Code that deliberately
inspects the prelude's own stack frame could still find the sentinel: the check stops early exits,
not an adversary inside the interpreter; that is what the containment above is for.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

__all__ = ["CODE_EXEC_ENV", "HF_CODE_EVAL_ENV", "NETWORK_ERROR", "CodeExecutionNotAllowed", "CodeLimits",
           "Containment", "SandboxResult", "SandboxUnavailable", "code_execution_allowed", "containment", "run_program"]

NETWORK_ERROR = "network access is disabled in the tadm sandbox"
CODE_EXEC_ENV = "TADM_ALLOW_CODE_EXEC"
HF_CODE_EVAL_ENV = "HF_ALLOW_CODE_EVAL"
MODES = ("tests", "script")
_DIR_PREFIX = "tadm-sandbox-"
_MARKER_ENV = "TADM_SANDBOX_RUN"
_SETUP_FAILED = 97  # the prelude's exit status when it cannot put its containment in place


class CodeExecutionNotAllowed(PermissionError):
    """Model-written code was about to run without the user's opt-in."""


class SandboxUnavailable(RuntimeError):
    """This machine cannot contain the code as asked (no network namespace, and network not allowed)."""


def code_execution_allowed(flag: bool = False) -> bool:
    """True when the user opted in: ``flag`` (``--allow-code-execution``), ``TADM_ALLOW_CODE_EXEC=1`` or ``HF_ALLOW_CODE_EVAL=1``."""
    return bool(flag) or os.environ.get(CODE_EXEC_ENV) == "1" or os.environ.get(HF_CODE_EVAL_ENV) == "1"


def not_allowed_message(what: str) -> str:
    return (f"{what} runs model-written code; allow it with --allow-code-execution or {CODE_EXEC_ENV}=1 "
            f"({HF_CODE_EVAL_ENV}=1 is honoured too). It runs sandboxed; see 'Task evaluation' in the README")


# ------------------------------------------------------------------------------------------ prelude
# Runs as `python -I -B -c _PRELUDE MODE NONCE_FD NAMESPACES LANDLOCK` in the temporary directory.
_PRELUDE = r'''
import ctypes, os, runpy, socket, struct, sys
mode, nonce_fd, namespaces, landlock = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
nonce = os.read(nonce_fd, 64)
os.close(nonce_fd)
workdir = os.getcwd()
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def fail(message):
    os.write(2, ("tadm sandbox: " + message + "\n").encode())
    os._exit(97)

if namespaces:  # every mount read-only but the working directory (mount namespace of our own)
    if libc.mount(workdir.encode(), workdir.encode(), None, 4096, None) != 0:
        fail("cannot bind the working directory: " + os.strerror(ctypes.get_errno()))
    keep = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
    with open("/proc/self/mountinfo") as handle:
        mounts = [line.split() for line in handle]
    for fields in mounts:
        target = fields[4].encode().decode("unicode_escape")
        if target == workdir:
            continue
        flags = 32 | 4096 | 1  # MS_REMOUNT | MS_BIND | MS_RDONLY, keeping the locked flags
        for option in fields[5].split(","):
            flags |= keep.get(option, 0)
        if libc.mount(None, target.encode(), None, flags, None) != 0 and "rw" in fields[5].split(","):
            fail("cannot make " + target + " read-only: " + os.strerror(ctypes.get_errno()))

if landlock:  # writes only under the working directory; TCP and outside signals refused where supported
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    write = sum(1 << bit for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))
    write |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    attr = struct.pack("QQQ", write, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)[:size]
    ruleset = libc.syscall(444, ctypes.create_string_buffer(attr, size), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        fail("landlock: " + os.strerror(ctypes.get_errno()))
    for path, access in ((workdir, write), ("/dev/null", 2 | (1 << 14 if abi >= 3 else 0))):
        where = os.open(path, os.O_PATH)
        rule = ctypes.create_string_buffer(struct.pack("=Qi", access, where), 12)
        if libc.syscall(445, ctypes.c_int(ruleset), ctypes.c_int(1), rule, ctypes.c_uint32(0)) != 0:
            fail("landlock rule for " + path + ": " + os.strerror(ctypes.get_errno()))
        os.close(where)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.syscall(446, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
        fail("landlock: " + os.strerror(ctypes.get_errno()))
    os.close(ruleset)

def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the tadm sandbox")
socket.socket.__init__ = _no_network  # the class stays a class: ssl subclasses it
for name in ("create_connection", "create_server", "getaddrinfo", "socketpair", "fromfd"):
    setattr(socket, name, _no_network)
del ctypes, libc, struct
sys.argv = ["program.py"]
try:
    runpy.run_path("program.py", run_name="__main__")
except SystemExit as stop:
    if mode != "script" or stop.code not in (0, None):
        raise
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except Exception:
        os._exit(1)
os.write(2, b"\n" + nonce + b"\n")
os._exit(0)
'''


# -------------------------------------------------------------------------------------- containment
@dataclass(frozen=True)
class Containment:
    """What this machine lets the sandbox enforce."""

    namespaces: bool  # user + network + PID + mount namespaces through ``unshare``
    landlock_abi: int  # 0: no Landlock

    @property
    def network_blocked(self) -> bool:
        return self.namespaces

    @property
    def filesystem_contained(self) -> bool:
        return self.namespaces or self.landlock_abi >= 1

    @property
    def processes_contained(self) -> bool:
        """Every descendant dies at the end and none can signal the evaluator."""
        return self.namespaces

    def describe(self) -> str:
        network = "NETWORK OPEN" + (" (TCP blocked by Landlock)" if self.landlock_abi >= 4 else "")
        processes = "processes killed by session and marker (best effort)"
        if self.landlock_abi >= 6:
            processes += "; signals to the evaluator blocked"
        parts = ["no network" if self.network_blocked else network,
                 "writes only in its directory" if self.filesystem_contained else "FILE SYSTEM WRITABLE",
                 "own PID namespace" if self.processes_contained else processes]
        how = "+".join(x for x, on in (("namespaces", self.namespaces), (f"landlock-abi{self.landlock_abi}",
                                                                       self.landlock_abi >= 1)) if on) or "none"
        return f"{how}: " + ", ".join(parts)


def _landlock_abi() -> int:
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        abi = int(libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))
    except (OSError, AttributeError):
        return 0
    return max(0, abi)


_UNSHARE_FLAGS = ("--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc")


@functools.lru_cache(maxsize=1)
def containment() -> Containment:
    """Probe once what this machine allows: the namespaces (a real sandboxed run) and the Landlock ABI."""
    abi = _landlock_abi()
    can_unshare = shutil.which("unshare") is not None and sys.platform.startswith("linux")
    namespaces = can_unshare and _probe(Containment(True, abi))
    if not namespaces and abi >= 1 and not _probe(Containment(False, abi)):
        abi = 0
    return Containment(namespaces, abi)


def _probe(level: Containment) -> bool:
    """Does a trivial program run to its end under ``level``, and is a write outside its directory refused?
    False also when the sandboxed run cannot be started at all."""
    outside = os.path.join(tempfile.gettempdir(), f"{_DIR_PREFIX}probe-{os.getpid()}-{secrets.token_hex(4)}")
    code = f"try:\n    open({outside!r}, 'w').close()\nexcept OSError:\n    pass\nelse:\n    raise SystemExit(5)\n"
    try:
        return _run(code, stdin="", timeout=20.0, memory_mb=1024, max_output=4096, mode="tests", level=level).ok
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        with contextlib.suppress(OSError):  # a probe file left behind does not change what the probe found
            os.remove(outside)


# ------------------------------------------------------------------------------------------ running
@dataclass(frozen=True)
class CodeLimits:
    """How the checks of a code benchmark may run a program: limits and the user's permissions."""

    timeout: float = 10.0  # seconds of wall clock per program
    memory_mb: int = 1024
    allow_execution: bool = False  # the opt-in (the environment can also grant it)
    allow_network: bool = False  # run where the network cannot be blocked

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout, (int, float)) and 0 < self.timeout < float("inf")):
            raise ValueError(f"code timeout must be a number of seconds > 0, got {self.timeout!r}")
        if isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int) or self.memory_mb < 16:
            raise ValueError(f"code memory limit must be an integer number of MB >= 16, got {self.memory_mb!r}")

    def run_kwargs(self) -> dict[str, object]:
        return asdict(self)  # the field names are run_program's keywords


@dataclass
class SandboxResult:
    """How a program ended.

    ``status``: "ok" (exit 0 and ran to its end), "incomplete" (exit 0 before its end: ``exit(0)``,
    ``os._exit(0)``), "error" (non-zero exit), "timeout", "memory", or "sandbox" (the containment
    could not be put in place).
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    completed: bool = False
    containment: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _limits(timeout: float, memory_mb: int):
    """The child's ``preexec_fn``: address-space and CPU-time limits."""
    memory = int(memory_mb) * 1024 * 1024
    cpu = int(timeout) + 1

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))

    return apply


def _environment(workdir: str, marker: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "TMPDIR": workdir,
            "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "no_proxy": "*", _MARKER_ENV: marker}


def _kill_everything(process: subprocess.Popen, marker: str) -> None:
    """SIGKILL the program's session and every process whose environment carries ``marker``.

    In a PID namespace killing ``unshare`` is enough (``--kill-child`` takes the namespace down); the
    marker scan catches ``setsid`` escapes where there is no namespace (best effort: a process that
    cleared its environment is not found).
    """
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    needle = f"{_MARKER_ENV}={marker}".encode()
    for _ in range(3):  # a fork during the scan is caught by the next pass
        found = False
        for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as handle:
                    if needle in handle.read():
                        os.kill(int(entry), signal.SIGKILL)
                        found = True
            except (OSError, ValueError):
                continue
        if not found:
            break


def _exchange(process: subprocess.Popen, data: bytes, deadline: float, cap: int) -> tuple[bytes, bytes, bytes, bool]:
    """Feed stdin and read stdout/stderr until both close (or, once the program exited, a grace of 0.25 s
    for descendants holding them) or ``deadline``: (stdout head, stderr head, stderr tail, timed out)."""
    out, err, tail = bytearray(), bytearray(), bytearray()
    selector = selectors.DefaultSelector()
    if process.stdin is not None:
        if data:
            os.set_blocking(process.stdin.fileno(), False)
            selector.register(process.stdin, selectors.EVENT_WRITE)
        else:
            process.stdin.close()
    selector.register(process.stdout, selectors.EVENT_READ, out)
    selector.register(process.stderr, selectors.EVENT_READ, err)
    view, sent = memoryview(data), 0
    drain_until = None  # the program exited: descendants that kept its pipes open get a short grace
    try:
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                return bytes(out), bytes(err), bytes(tail), True
            if drain_until is None and process.poll() is not None:
                drain_until = now + 0.25
            if drain_until is not None and now >= drain_until:
                break
            for key, _ in selector.select(timeout=min(deadline, drain_until or deadline, now + 0.05) - now):
                if key.fileobj is process.stdin:
                    try:
                        sent += os.write(key.fd, view[sent:sent + 65536])
                    except (BrokenPipeError, BlockingIOError, OSError):
                        sent = len(data)
                    if sent >= len(data):
                        selector.unregister(key.fileobj)
                        key.fileobj.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = key.data
                if len(buffer) < cap:
                    buffer += chunk[: cap - len(buffer)]
                if buffer is err:
                    tail += chunk
                    del tail[:-256]
    finally:
        selector.close()
        for stream in (process.stdin, process.stdout, process.stderr):
            if stream is not None and not stream.closed:
                stream.close()
    return bytes(out), bytes(err), bytes(tail), False


def _status(returncode: int | None, stderr: str, completed: bool) -> str:
    if returncode == _SETUP_FAILED and "tadm sandbox:" in stderr:
        return "sandbox"
    if returncode == 0:
        return "ok" if completed else "incomplete"
    if "MemoryError" in stderr or returncode in (-signal.SIGKILL, -signal.SIGSEGV, 128 + signal.SIGKILL):
        return "memory"
    if returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "timeout"
    return "error"


def _remove_tree(path: str) -> None:
    def writable(func, target, _exc):  # a program may have taken its own write permission away
        try:
            os.chmod(os.path.dirname(target) or target, 0o700)
            os.chmod(target, 0o700)
            func(target)
        except OSError:
            pass

    shutil.rmtree(path, onerror=writable)


def _sweep_leftovers() -> None:
    """Remove sandbox directories whose evaluator process no longer exists (it was killed mid-run)."""
    pattern = re.compile(rf"^{_DIR_PREFIX}(\d+)-")
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        found = pattern.match(name)
        if found is None or int(found.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(found.group(1)), 0)
        except ProcessLookupError:
            _remove_tree(os.path.join(root, name))
        except PermissionError:
            continue


def _run(code: str, *, stdin: str, timeout: float, memory_mb: int, max_output: int, mode: str,
         level: Containment) -> SandboxResult:
    workdir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
    nonce, marker = secrets.token_hex(16).encode(), secrets.token_hex(8)
    read_end, write_end = os.pipe()
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as handle:
            handle.write(code)
        os.write(write_end, nonce)
        os.close(write_end)
        write_end = -1
        prefix = (shutil.which("unshare") or "unshare", *_UNSHARE_FLAGS) if level.namespaces else ()
        command = [*prefix, sys.executable, "-I", "-B", "-c", _PRELUDE, mode, str(read_end),
                   "1" if level.namespaces else "0", "1" if level.landlock_abi >= 1 else "0"]
        start = time.monotonic()
        deadline = start + timeout
        process = subprocess.Popen(command, cwd=workdir, env=_environment(workdir, marker), stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(read_end,),
                                   preexec_fn=_limits(timeout, memory_mb), start_new_session=True)
        os.close(read_end)
        read_end = -1
        try:
            out, err, tail, timed_out = _exchange(process, stdin.encode("utf-8"), deadline, max_output)
            if not timed_out:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            _kill_everything(process, marker)
            try:
                process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
        seconds = time.monotonic() - start
        sentinel = b"\n" + nonce + b"\n"
        completed = not timed_out and tail.endswith(sentinel)
        if completed and err.endswith(sentinel):
            err = err[: -len(sentinel)]
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        # a timed-out run is never completed
        status = "timeout" if timed_out else _status(process.returncode, stderr, completed)
        return SandboxResult(status, None if timed_out else process.returncode, stdout, stderr, seconds, completed,
                             level.describe())
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
        _remove_tree(workdir)


def run_program(code: str, *, stdin: str = "", timeout: float = 10.0, memory_mb: int = 1024,
                max_output: int = 1 << 20, mode: str = "tests", allow_execution: bool = False,
                allow_network: bool = False) -> SandboxResult:
    """Run Python ``code`` in the sandbox (module docstring); never in this process.

    Args:
        code: the program.
        stdin: its standard input.
        timeout: wall-clock seconds (also the CPU-time limit, plus one second).
        memory_mb: address-space limit.
        max_output: characters of stdout and of stderr kept.
        mode: ``"tests"`` (any ``SystemExit`` is an early end) or ``"script"`` (``SystemExit`` 0 is a
            normal end, as for a stdin program).
        allow_execution: the user's opt-in (also granted by the environment, :func:`code_execution_allowed`).
        allow_network: run even where the network cannot be blocked.

    Raises:
        CodeExecutionNotAllowed: without the opt-in.
        SandboxUnavailable: the network cannot be blocked here and ``allow_network`` is False.
    """
    if not code_execution_allowed(allow_execution):
        raise CodeExecutionNotAllowed(not_allowed_message("this check"))
    if not (timeout > 0 and memory_mb > 0):  # NaN fails too
        raise ValueError(f"timeout and memory_mb must be > 0, got {timeout}, {memory_mb}")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is unknown; valid: {', '.join(MODES)}")
    level = containment()
    if not level.network_blocked and not allow_network:
        raise SandboxUnavailable(
            "this machine does not allow a network namespace (unshare --user --net), so generated code could "
            "reach the network; run it in a container, or accept network access with --allow-code-network")
    _sweep_leftovers()
    return _run(code, stdin=stdin, timeout=float(timeout), memory_mb=int(memory_mb), max_output=max_output,
                mode=mode, level=level)
