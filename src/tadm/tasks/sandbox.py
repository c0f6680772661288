"""Running generated code for the code benchmarks (HumanEval, LiveCodeBench) outside the evaluating process.

:func:`run_program` writes the program into a fresh temporary directory and runs it there with
``sys.executable -I`` (isolated mode: no user site-packages, no ``PYTHON*`` variables, the script's
directory not on ``sys.path``) in its own process group, with

* a wall-clock time limit (the whole process group is killed when it is exceeded), and a CPU-time
  limit (``RLIMIT_CPU``) of the same length plus one second;
* a memory limit: ``RLIMIT_AS`` set in the child before it starts (``preexec_fn``), so a program that
  allocates too much gets ``MemoryError`` or is killed;
* no network: where the machine allows it, the program runs in a network namespace of its own with
  no interfaces (``unshare -rn``); in any case, before the program runs, a prelude makes creating a ``socket.socket``
  (and its subclasses, e.g. ``ssl``) raise ``OSError``, and replaces ``socket.create_connection``,
  ``create_server``, ``getaddrinfo``, ``socketpair`` and ``fromfd`` by a function that raises it;
* a minimal environment (``HOME`` and ``TMPDIR`` in the temporary directory), which is removed
  afterwards with everything the program wrote.

This keeps honest mistakes of a model's code (infinite loops, memory hogs, stray files, network
calls) away from the evaluation; it is **not a security boundary**: without the namespace, code that
imports ``_socket`` or uses ``ctypes`` can get around the socket block, and the file system is
shared. Run untrusted models' code in a container or VM.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

__all__ = ["NETWORK_ERROR", "SandboxResult", "run_program"]

NETWORK_ERROR = "network access is disabled in the tadm sandbox"

_PRELUDE = f"""\
import runpy, socket, sys
def _no_network(*args, **kwargs):
    raise OSError({NETWORK_ERROR!r})
socket.socket.__init__ = _no_network  # the class stays a class: ssl subclasses it
for _name in ("create_connection", "create_server", "getaddrinfo", "socketpair", "fromfd"):
    setattr(socket, _name, _no_network)
del _name
sys.argv = ["program.py"]
runpy.run_path("program.py", run_name="__main__")
"""


@dataclass
class SandboxResult:
    """How a program ended: ``status`` is "ok" (exit 0), "error" (non-zero exit), "timeout" or "memory"."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

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


@functools.lru_cache(maxsize=1)
def _network_namespace_prefix() -> tuple[str, ...]:
    """``unshare -rn`` when this machine lets an unprivileged process enter a network namespace of its own
    (no interfaces: no network at all), else nothing (the prelude's socket block remains)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    try:
        probe = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ()
    return (unshare, "-rn") if probe.returncode == 0 else ()


def _environment(workdir: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "TMPDIR": workdir,
            "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "no_proxy": "*"}


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _status(returncode: int, stderr: str) -> str:
    if returncode == 0:
        return "ok"
    if "MemoryError" in stderr or returncode in (-signal.SIGKILL, -signal.SIGSEGV):
        return "memory"
    if returncode in (-signal.SIGXCPU,):
        return "timeout"
    return "error"


def run_program(code: str, *, stdin: str = "", timeout: float = 10.0, memory_mb: int = 1024,
                max_output: int = 1 << 20) -> SandboxResult:
    """Run Python ``code`` in a subprocess in a temporary directory; never in this process.

    Returns its status, exit code, stdout and stderr (each cut to ``max_output`` characters) and wall time.
    """
    if timeout <= 0 or memory_mb <= 0:
        raise ValueError(f"timeout and memory_mb must be > 0, got {timeout}, {memory_mb}")
    workdir = tempfile.mkdtemp(prefix="tadm-sandbox-")
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as handle:
            handle.write(code)
        start = time.perf_counter()
        command = [*_network_namespace_prefix(), sys.executable, "-I", "-c", _PRELUDE]
        process = subprocess.Popen(command, cwd=workdir, env=_environment(workdir),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   preexec_fn=_limits(timeout, memory_mb), start_new_session=True)
        try:
            out, err = process.communicate(stdin.encode("utf-8"), timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            out, err = process.communicate()
            return SandboxResult("timeout", None, out.decode("utf-8", "replace")[:max_output],
                                 err.decode("utf-8", "replace")[:max_output], time.perf_counter() - start)
        _kill_group(process)  # children it left behind
        stdout, stderr = out.decode("utf-8", "replace")[:max_output], err.decode("utf-8", "replace")[:max_output]
        return SandboxResult(_status(process.returncode, stderr), process.returncode, stdout, stderr,
                             time.perf_counter() - start)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
