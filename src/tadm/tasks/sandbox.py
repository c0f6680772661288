"""Running model-written code (HumanEval, LiveCodeBench) in a sandbox that enforces its limits.

Code a model wrote is untrusted. :func:`run_program` runs it only after an explicit opt-in
(:func:`code_execution_allowed`: ``--allow-code-execution``, ``TADM_ALLOW_CODE_EXEC=1``, or lm-eval's
``HF_ALLOW_CODE_EVAL=1``), in a fresh temporary directory, as two processes of
:mod:`tadm.tasks.sandbox_child` started with ``python -I -B`` and an environment of their own (``PATH``,
``HOME`` and ``TMPDIR`` in the directory, the locale; no variable of the evaluator, tokens included):

* the **harness** holds the checks (a HumanEval ``check``, a LiveCodeBench call) and the only pipe the
  verdict comes back on; every descendant of the program is its child or orphan (it is PID 1 of the
  namespace, else their subreaper), and it kills them all, ``setsid`` ones included, before it answers;
* the **program** runs the model's code, then answers the harness's calls of its functions through a
  pipe: arguments and results cross as copies of plain data (numbers, strings, containers).

**Honest scoring.** A program with checks is correct only when the checks, run in the harness, returned.
The program never holds the verdict's pipe nor anything that decides it, so reading its own stack frames,
objects or file descriptors finds nothing to forge; ``exit(0)`` or ``os._exit(0)`` before or during the
checks ends it unscored (``"incomplete"``); and a result is a copy, so an object whose ``__eq__`` always
holds cannot pass a check. Without checks (``"script"`` mode, stdin programs) the output is what is
compared; there ``SystemExit`` 0 is a normal end, as on a judge.

**Containment**, with every part this machine offers (:func:`containment` probes them once):

* **Linux namespaces** (``unshare``; no root needed where unprivileged user namespaces are allowed): a
  network namespace with no interface (no network; abstract Unix sockets belong to it), a PID namespace
  (the program sees only its own processes; none can signal the evaluator; every descendant dies with
  it) and a mount namespace in which every mount is read-only but the temporary directory; no capability
  is left in it, so nothing can be remounted;
* **Landlock** (Linux >= 5.13): writes refused outside the temporary directory (and ``/dev/null``); files
  under ``/proc`` readable only for the program's own process (no other process's environment, command
  line, memory or open files); no ptrace of a process outside the sandbox; from ABI 4 no TCP; from ABI 6
  no signal and no abstract Unix socket out of the sandbox;
* **seccomp** (Linux on x86-64 and ARM64): ``socket()`` refused (no TCP, UDP, raw or Unix socket, so no
  network and no local listener, socket file or abstract name), only connected stream pairs allowed;
  ``connect``, ``sendto`` an address, io_uring, ptrace and other processes' memory refused; no signal to
  the harness, to the evaluator (its threads when the run starts) or to every process at once.

Always: a wall-clock time limit after which everything the program started is killed (but for the gap
``leftover-processes``), reading its output never waits past that limit (plus a second for the harness to
answer), a CPU-time limit (``RLIMIT_CPU``), an address-space limit (``RLIMIT_AS``), no new privileges on
Linux (setuid programs run without theirs), and removal of the temporary directory (one left by an
evaluator that was killed is removed by the next run). Never contained: reading the files the user can
read (outside ``/proc`` under Landlock); what is read can leave only through the program's own output.

What the machine cannot contain is a **gap**; :meth:`Containment.gaps` names each with its sentence:

* ``network`` (neither namespaces nor seccomp): UDP and raw sockets (and TCP below Landlock ABI 4) reach
  other machines;
* ``local-sockets`` (no seccomp): the host's Unix socket files (and abstract sockets, unless namespaces or
  Landlock ABI 6 hold those);
* ``file-writes`` (neither namespaces nor Landlock): writes wherever the user can, the evaluator's memory
  through ``/proc/<pid>/mem`` included;
* ``process-files`` (neither namespaces nor Landlock): the ``/proc`` files of the user's processes, their
  environments included;
* ``signals`` (no namespaces, Landlock ABI < 6): signals to the user's other processes;
* ``leftover-processes`` (no namespaces, no seccomp, Landlock ABI < 6): the program can kill the harness,
  so a ``setsid`` descendant may outlive the run.

Code runs despite a gap only when the user accepts that gap by name (``allow_uncontained``,
``--allow-uncontained-code GAP[,GAP]``); otherwise :class:`SandboxUnavailable` names the gaps and the flag.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import math
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
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import IO

from tadm.tasks import sandbox_child
from tadm.tasks.sandbox_child import ARCHES, NETWORK_ERROR, SETUP_FAILED

__all__ = ["CODE_EXEC_ENV", "GAPS", "HF_CODE_EVAL_ENV", "MIN_TIMEOUT", "NETWORK_ERROR", "CodeExecutionNotAllowed",
           "CodeLimits", "Containment", "SandboxResult", "SandboxUnavailable", "code_execution_allowed",
           "containment", "parse_gaps", "run_program", "uncontained_message"]

CODE_EXEC_ENV = "TADM_ALLOW_CODE_EXEC"
HF_CODE_EVAL_ENV = "HF_ALLOW_CODE_EVAL"
MODES = ("tests", "script")
GAPS = ("network", "local-sockets", "file-writes", "process-files", "signals", "leftover-processes")
# Two interpreters start before the program's first line: a trivial HumanEval check takes 0.3 s (median; 0.6 s at
# most) on a two-core machine under a load of 9. Below a second, the limit would score start-up, not code.
MIN_TIMEOUT = 1.0
_HARNESS_GRACE = 1.0  # seconds past the limit the harness has to kill everything and answer
_CHILD = os.path.abspath(sandbox_child.__file__)
_DIR_PREFIX = "tadm-sandbox-"
_MARKER_ENV = "TADM_SANDBOX_RUN"


class CodeExecutionNotAllowed(PermissionError):
    """Model-written code was about to run without the user's opt-in."""


class SandboxUnavailable(RuntimeError):
    """This machine cannot contain the code as asked: a gap the user did not accept."""


def code_execution_allowed(flag: bool = False) -> bool:
    """True when the user opted in: ``flag`` (``--allow-code-execution``), ``TADM_ALLOW_CODE_EXEC=1`` or ``HF_ALLOW_CODE_EVAL=1``."""
    return bool(flag) or os.environ.get(CODE_EXEC_ENV) == "1" or os.environ.get(HF_CODE_EVAL_ENV) == "1"


def not_allowed_message(what: str) -> str:
    return (f"{what} runs model-written code; allow it with --allow-code-execution or {CODE_EXEC_ENV}=1 "
            f"({HF_CODE_EVAL_ENV}=1 is honoured too). It runs sandboxed; see 'Task evaluation' in the README")


# -------------------------------------------------------------------------------------- containment
@dataclass(frozen=True)
class Containment:
    """What this machine lets the sandbox enforce (module docstring)."""

    namespaces: bool  # user + network + PID + mount namespaces through ``unshare``
    landlock_abi: int  # 0: no Landlock
    seccomp: bool  # the system-call filter of :func:`tadm.tasks.sandbox_child.seccomp_program`

    @property
    def name(self) -> str:
        parts = [("namespaces", self.namespaces), (f"landlock-abi{self.landlock_abi}", self.landlock_abi >= 1),
                 ("seccomp", self.seccomp)]
        return "+".join(part for part, on in parts if on) or "none"

    def gaps(self) -> dict[str, str]:
        """What this level does not contain, by name (:data:`GAPS`), each with what the program can then do."""
        ns, abi, filtered = self.namespaces, self.landlock_abi, self.seccomp
        found = {}
        if not ns and not filtered:
            found["network"] = ("UDP and raw sockets reach other machines (TCP is refused by Landlock)" if abi >= 4
                                else "TCP, UDP and raw sockets reach other machines")
        if not filtered:
            which = "socket files" if ns or abi >= 6 else "socket files and abstract sockets"
            found["local-sockets"] = (f"the program can connect to the host's Unix {which} (a Docker or ssh-agent "
                                      "socket, D-Bus) and talk to the services behind them")
        if not ns and abi == 0:
            found["file-writes"] = ("the program can write wherever the user can: any file, the evaluator's "
                                    "included, and the memory of the user's processes through /proc/<pid>/mem, so it "
                                    "can also change its own score")
            found["process-files"] = ("the program can read the /proc files of every process of the user: "
                                      "environments (tokens included), command lines, open files, the evaluator's "
                                      "included")
        if not ns and abi < 6:
            found["signals"] = "the program can signal (kill, stop) every process of the user" + (
                " except the harness and the evaluator's threads at its start" if filtered else
                ", the evaluator included")
        if not ns and not filtered and abi < 6:
            found["leftover-processes"] = ("the program can kill the harness that reaps its descendants, so one "
                                           "started with setsid may outlive the run (the sweep by an environment "
                                           "marker is best effort)")
        return found

    def describe(self) -> str:
        gaps = self.gaps()
        held = [gap for gap in GAPS if gap not in gaps]
        text = f"{self.name}: " + (", ".join(held) + " contained" if held else "nothing contained")
        return text + ("; NOT CONTAINED: " + ", ".join([*gaps, "file reads"]) if gaps else "; file reads not contained")


def uncontained_message(level: Containment, allowed: Iterable[str] = ()) -> str | None:
    """None when every gap of ``level`` is in ``allowed``; else one line naming them and the flag that accepts them."""
    missing = {gap: why for gap, why in level.gaps().items() if gap not in set(allowed)}
    if not missing:
        return None
    return (f"this machine's code sandbox ({level.name}) does not contain "
            + "; ".join(f"{gap} ({why})" for gap, why in missing.items())
            + f". Run the evaluation in a container or VM, or accept {'this' if len(missing) == 1 else 'these'} "
            f"with --allow-uncontained-code {','.join(missing)}")


def parse_gaps(value: Iterable[str] | str) -> tuple[str, ...]:
    """Gap names (:data:`GAPS`) from a comma-separated string or a list; an unknown name is a ValueError."""
    names = [v.strip() for v in value.split(",")] if isinstance(value, str) else [str(v).strip() for v in value]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in GAPS]
    if unknown:
        raise ValueError(f"unknown sandbox gap {unknown[0]!r}; valid: {', '.join(GAPS)}")
    return tuple(dict.fromkeys(names))


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _landlock_abi() -> int:
    if not sys.platform.startswith("linux"):
        return 0
    try:
        abi = int(_libc().syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))
    except (OSError, AttributeError):
        return 0
    return max(0, abi)


def _seccomp_available() -> bool:
    if not sys.platform.startswith("linux") or os.uname().machine not in ARCHES:
        return False
    try:
        return _libc().prctl(ctypes.c_int(21), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0),
                             ctypes.c_ulong(0)) >= 0  # PR_GET_SECCOMP: -1 (EINVAL) without seccomp
    except (OSError, AttributeError):
        return False


_UNSHARE_FLAGS = ("--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc")


@functools.lru_cache(maxsize=1)
def containment() -> Containment:
    """Probe once what this machine allows (a real sandboxed run per level tried, strongest first)."""
    abi, filtered = _landlock_abi(), _seccomp_available()
    can_unshare = shutil.which("unshare") is not None and sys.platform.startswith("linux")
    tried = [Containment(True, abi, filtered)] if can_unshare else []
    tried += [Containment(False, abi, filtered), Containment(False, 0, filtered), Containment(False, 0, False)]
    for level in dict.fromkeys(tried):
        if _probe(level):
            return level
    return tried[-1]


def _probe(level: Containment) -> bool:
    """Do a program and its checks run to their end under ``level``, with a write outside its directory refused
    where the level contains writes and a socket refused where it filters them? False also when the sandboxed run
    cannot be started at all."""
    outside = os.path.join(tempfile.gettempdir(), f"{_DIR_PREFIX}probe-{os.getpid()}-{secrets.token_hex(4)}")
    code = "def answer():\n    return 42\n"
    if "file-writes" not in level.gaps():
        code += f"try:\n    open({outside!r}, 'w').close()\nexcept OSError:\n    pass\nelse:\n    raise SystemExit(5)\n"
    if level.seccomp:
        code += ("import _socket\ntry:\n    _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)\n"
                 "except PermissionError:\n    pass\nelse:\n    raise SystemExit(6)\n")
    try:
        return _run(code, stdin="", timeout=20.0, memory_mb=1024, max_output=4096, mode="tests",
                    checks="assert program.function('answer')() == 42\n", level=level).ok
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        with contextlib.suppress(OSError):  # a probe file left behind does not change what the probe found
            os.remove(outside)


# ------------------------------------------------------------------------------------------ running
@dataclass(frozen=True)
class CodeLimits:
    """How the checks of a code benchmark may run a program: limits and the user's permissions."""

    timeout: float = 10.0  # seconds of wall clock per program, at least MIN_TIMEOUT
    memory_mb: int = 1024
    allow_execution: bool = False  # the opt-in (the environment can also grant it)
    allow_uncontained: tuple[str, ...] = field(default=())  # gaps of this machine's sandbox the user accepts

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout, (int, float)) and MIN_TIMEOUT <= self.timeout < float("inf")):
            raise ValueError(f"code timeout must be a number of seconds >= {MIN_TIMEOUT:g} (the sandbox starts two "
                             f"Python interpreters before the program's first line), got {self.timeout!r}")
        if isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int) or self.memory_mb < 16:
            raise ValueError(f"code memory limit must be an integer number of MB >= 16, got {self.memory_mb!r}")
        object.__setattr__(self, "allow_uncontained", parse_gaps(self.allow_uncontained))

    def run_kwargs(self) -> dict[str, object]:
        return asdict(self)  # the field names are run_program's keywords


@dataclass
class SandboxResult:
    """How a program ended.

    ``status``: "ok" (its checks returned; without checks, it ran to its end and exited 0), "incomplete"
    (exit 0 before its end or its checks': ``exit(0)``, ``os._exit(0)``), "error" (a non-zero exit or a
    failed check), "timeout", "memory", or "sandbox" (the containment could not be put in place).
    ``checks_output``: what the checks printed (a LiveCodeBench call prints its result there).
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    completed: bool = False
    containment: str = ""
    checks_output: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _limits(timeout: float, memory_mb: int):
    """The child's ``preexec_fn``: address-space and CPU-time limits."""
    memory = int(memory_mb) * 1024 * 1024
    cpu = int(math.ceil(timeout)) + 1

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))

    return apply


def _environment(workdir: str, marker: str) -> dict[str, str]:
    """The sandbox's whole environment: nothing of the evaluator's (its PATH neither)."""
    path = os.pathsep.join(dict.fromkeys([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]))
    return {"PATH": path, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
            "no_proxy": "*", _MARKER_ENV: marker}


def _evaluator_ids() -> list[int]:
    """This process's id, its threads' ids and its negated process group (what ``kill`` would take to reach it)."""
    pid = os.getpid()
    try:
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit()][:1000]
    except OSError:
        threads = []
    return sorted({pid, *threads, -os.getpgid(0)})


def _kill_everything(process: subprocess.Popen, marker: str) -> None:
    """SIGKILL the harness's process group and every process whose environment carries ``marker``.

    The harness kills the program's descendants itself; this is the fallback for a harness that did not
    answer (in a PID namespace, killing ``unshare`` takes the namespace down with ``--kill-child``).
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
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


def _exchange(process: subprocess.Popen, data: bytes, readers: list[tuple[IO[bytes], int]],
              deadline: float) -> tuple[list[bytes], bool]:
    """Feed stdin and read every reader (up to its cap) until all close (or, once the process exited, a grace
    of 0.25 s for descendants holding them) or ``deadline``: (what each gave, cut off at the deadline)."""
    buffers = [bytearray() for _ in readers]
    selector = selectors.DefaultSelector()
    if process.stdin is not None:
        if data:
            os.set_blocking(process.stdin.fileno(), False)
            selector.register(process.stdin, selectors.EVENT_WRITE)
        else:
            process.stdin.close()
    for (reader, cap), buffer in zip(readers, buffers):
        selector.register(reader, selectors.EVENT_READ, (buffer, cap))
    view, sent = memoryview(data), 0
    drain_until = None  # the process exited: descendants that kept its pipes open get a short grace
    try:
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                return [bytes(b) for b in buffers], True
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
                buffer, cap = key.data
                if len(buffer) < cap:
                    buffer += chunk[: cap - len(buffer)]
    finally:
        selector.close()
        for stream in [process.stdin, *(reader for reader, _ in readers)]:
            if stream is not None and not stream.closed:
                stream.close()
    return [bytes(b) for b in buffers], False


def _stop(process: subprocess.Popen, marker: str, level: Containment, answered: bool) -> None:
    """Let the harness finish (it kills the program's descendants), then make sure nothing is left: its process
    group, and, when it did not answer, every process carrying the run's marker."""
    try:
        process.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        answered = False
        if not level.namespaces:  # the harness kills every descendant on SIGTERM
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=1.0)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    if not answered:
        _kill_everything(process, marker)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=2.0)


def _status(returncode: int | None, stderr: str, completed: bool) -> str:
    if returncode == SETUP_FAILED and "tadm sandbox:" in stderr:
        return "sandbox"
    if returncode == 0:
        return "ok" if completed else "incomplete"
    if "MemoryError" in stderr or returncode in (-signal.SIGKILL, -signal.SIGSEGV, 128 + signal.SIGKILL):
        return "memory"
    if returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "timeout"
    return "error"


def _outcome(verdict: dict | None, harness_code: int | None, stderr: str,
             cut_off: bool) -> tuple[str, int | None, bool]:
    """(status, the program's exit status, completed) from the harness's verdict."""
    if verdict is None:  # the harness did not answer
        if cut_off:
            return "timeout", None, False
        return ("sandbox" if _status(harness_code, stderr, False) == "sandbox" else "error"), harness_code, False
    status, code = verdict.get("status"), verdict.get("returncode")
    code = code if isinstance(code, int) else None
    if status == "ok":
        return "ok", code, True
    if status in ("timeout", "stopped"):
        return "timeout", None, False
    if status == "sandbox":
        return "sandbox", code, False
    if status == "failed":
        return ("memory" if verdict.get("error") == "MemoryError" else "error"), code, False
    completed = status == "exited" and verdict.get("completed") is True
    return _status(code, stderr, completed), code, completed


def _verdict(raw: bytes, nonce: str) -> dict | None:
    """The harness's verdict, if it is one (a line of JSON carrying this run's nonce)."""
    try:
        verdict = json.loads(raw.decode("utf-8"))
    except ValueError:
        return None
    return verdict if isinstance(verdict, dict) and verdict.get("nonce") == nonce else None


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
         checks: str | None, level: Containment) -> SandboxResult:
    workdir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
    nonce, marker = secrets.token_hex(16), secrets.token_hex(8)
    verdict_read, verdict_write = os.pipe()
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as handle:
            handle.write(code)
        start = time.monotonic()
        setup = {"nonce": nonce, "mode": mode, "checks": checks, "deadline": start + timeout,
                 "namespaces": level.namespaces, "landlock": level.landlock_abi, "seccomp": level.seccomp,
                 "protected": [] if level.namespaces else _evaluator_ids(), "memory_mb": memory_mb,
                 "max_output": max_output}
        with open(os.path.join(workdir, "harness.json"), "w", encoding="utf-8") as handle:
            json.dump(setup, handle)  # the harness reads and deletes it before the program starts
        prefix = (shutil.which("unshare") or "unshare", *_UNSHARE_FLAGS) if level.namespaces else ()
        command = [*prefix, sys.executable, "-I", "-B", _CHILD, "harness", "harness.json", str(verdict_write)]
        process = subprocess.Popen(command, cwd=workdir, env=_environment(workdir, marker), stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(verdict_write,),
                                   preexec_fn=_limits(timeout, memory_mb), start_new_session=True)
        os.close(verdict_write)
        verdict_write = -1
        verdict_file = os.fdopen(verdict_read, "rb")
        verdict_read = -1
        out, err, raw, cut_off = b"", b"", b"", True
        try:
            (out, err, raw), cut_off = _exchange(process, stdin.encode("utf-8"),
                                                 [(process.stdout, max_output), (process.stderr, max_output),
                                                  (verdict_file, 4 * max_output + 65536)],
                                                 start + timeout + _HARNESS_GRACE)
        finally:
            verdict = _verdict(raw, nonce)
            _stop(process, marker, level, answered=verdict is not None and verdict.get("clean") is True)
        seconds = time.monotonic() - start
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        status, returncode, completed = _outcome(verdict, process.returncode, stderr, cut_off)
        return SandboxResult(status, returncode, stdout, stderr, seconds, completed, level.describe(),
                             str((verdict or {}).get("output", "")))
    finally:
        for fd in (verdict_read, verdict_write):
            if fd >= 0:
                os.close(fd)
        _remove_tree(workdir)


def run_program(code: str, *, stdin: str = "", timeout: float = 10.0, memory_mb: int = 1024,
                max_output: int = 1 << 20, mode: str = "tests", checks: str | None = None,
                allow_execution: bool = False, allow_uncontained: Iterable[str] = ()) -> SandboxResult:
    """Run Python ``code`` in the sandbox (module docstring); never in this process.

    Args:
        code: the program (run as ``__main__`` from ``program.py`` in its directory).
        stdin: its standard input.
        timeout: wall-clock seconds, at least :data:`MIN_TIMEOUT` (also the CPU-time limit, plus one second).
        memory_mb: address-space limit.
        max_output: characters of stdout, of stderr and of the checks' output kept.
        mode: ``"tests"`` (any ``SystemExit`` is an early end) or ``"script"`` (``SystemExit`` 0 is a
            normal end, as for a stdin program; no checks).
        checks: Python run in the harness once the program's code ran to its end; ``program.function(name)``
            and ``program.method(cls, name)`` call into the program. The run is "ok" only if they return.
        allow_execution: the user's opt-in (also granted by the environment, :func:`code_execution_allowed`).
        allow_uncontained: the gaps of this machine's sandbox (:data:`GAPS`) the user accepts.

    Raises:
        CodeExecutionNotAllowed: without the opt-in.
        SandboxUnavailable: this machine's sandbox has a gap not in ``allow_uncontained``.
    """
    if not code_execution_allowed(allow_execution):
        raise CodeExecutionNotAllowed(not_allowed_message("this check"))
    if not (MIN_TIMEOUT <= timeout < float("inf") and memory_mb > 0):  # NaN fails too
        raise ValueError(f"timeout must be >= {MIN_TIMEOUT:g} seconds and memory_mb > 0, got {timeout}, {memory_mb}")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is unknown; valid: {', '.join(MODES)}")
    if checks is not None and mode != "tests":
        raise ValueError("checks run in 'tests' mode only")
    level = containment()
    message = uncontained_message(level, parse_gaps(allow_uncontained))
    if message is not None:
        raise SandboxUnavailable(message)
    _sweep_leftovers()
    return _run(code, stdin=stdin, timeout=float(timeout), memory_mb=int(memory_mb), max_output=max_output,
                mode=mode, checks=checks, level=level)
