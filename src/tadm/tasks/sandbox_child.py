"""What runs inside tadm's code sandbox (:mod:`tadm.tasks.sandbox`): the harness and the program's prelude.

Standard library only: both run as ``python -I -B sandbox_child.py ...``, an isolated interpreter that does
not see tadm. Two processes run from this file:

* the **harness** (``harness SETUP VERDICT_FD``) reads its setup and deletes it, puts the containment in
  place (read-only mounts, no capabilities, Landlock, the seccomp filter, reaping of every descendant),
  starts the program and, when the program comes with checks, runs those checks itself: the function
  under test is called through a pipe, and only data (numbers, strings, containers) crosses it. The
  harness alone holds the pipe its verdict goes to, and it kills every descendant before it answers;
* the **program** (``program MODE REQUEST_FD RESPONSE_FD LANDLOCK_ABI``) adds a Landlock domain of its own
  (no ptrace of or signal to the harness, no reads of other processes' ``/proc`` files), runs the model's
  code as ``__main__`` and then serves the harness's calls. Nothing in it decides its score, so nothing in
  its memory, stack frames or file descriptors can forge one.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
import types

SETUP_FAILED = 97  # exit status of a process that could not put its containment in place
ARCHES = {  # machine: (AUDIT_ARCH_*, {syscall: number}); the filter refuses every other architecture
    "x86_64": (0xC000003E, {"socket": 41, "connect": 42, "sendto": 44, "socketpair": 53, "kill": 62, "fcntl": 72,
                            "ioctl": 16, "ptrace": 101, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129,
                            "rt_tgsigqueueinfo": 297, "process_vm_readv": 310, "process_vm_writev": 311,
                            "pidfd_send_signal": 424, "io_uring_setup": 425, "io_uring_enter": 426,
                            "io_uring_register": 427, "pidfd_open": 434, "pidfd_getfd": 438, "capset": 126}),
    "aarch64": (0xC00000B7, {"socket": 198, "connect": 203, "sendto": 206, "socketpair": 199, "kill": 129,
                             "fcntl": 25, "ioctl": 29, "ptrace": 117, "tkill": 130, "tgkill": 131,
                             "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240, "process_vm_readv": 270,
                             "process_vm_writev": 271, "pidfd_send_signal": 424, "io_uring_setup": 425,
                             "io_uring_enter": 426, "io_uring_register": 427, "pidfd_open": 434, "pidfd_getfd": 438,
                             "capset": 91}),
}
NETWORK_ERROR = "network access is disabled in the tadm sandbox"


class SetupError(Exception):
    """The containment could not be put in place."""


class Deadline(BaseException):
    """The time limit passed (a BaseException: the checks' ``except Exception`` does not swallow it)."""


class Stopped(BaseException):
    """The evaluator asked the harness to stop (SIGTERM)."""


class ProgramEnded(BaseException):
    """The program's process ended while the checks still needed it."""


class ProtocolError(BaseException):
    """The program's process answered something that is not a message of the protocol."""


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _prctl(libc: ctypes.CDLL, option: int, *args: int) -> int:
    padded = [ctypes.c_ulong(a) for a in (*args, 0, 0, 0, 0)[:4]]
    return libc.prctl(ctypes.c_int(option), *padded)


def _error(what: str) -> SetupError:
    return SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


# ------------------------------------------------------------------------------------- containment
def read_only_mounts(libc: ctypes.CDLL, workdir: str) -> None:
    """Every mount read-only but ``workdir`` (bound onto itself), in the mount namespace of our own."""
    if libc.mount(workdir.encode(), workdir.encode(), None, ctypes.c_ulong(4096), None) != 0:  # MS_BIND
        raise _error("cannot bind the working directory")
    keep = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        mounts = [line.split() for line in handle]
    for fields in mounts:
        target = fields[4].encode().decode("unicode_escape")
        if target == workdir:
            continue
        flags = 32 | 4096 | 1  # MS_REMOUNT | MS_BIND | MS_RDONLY, keeping the locked flags
        for option in fields[5].split(","):
            flags |= keep.get(option, 0)
        if libc.mount(None, target.encode(), None, ctypes.c_ulong(flags), None) != 0 and "rw" in fields[5].split(","):
            raise _error(f"cannot make {target} read-only")
    os.chdir(workdir)  # the working directory is now the writable bind mount, not the read-only one below it


def drop_capabilities(libc: ctypes.CDLL) -> None:
    """No capability now or after any exec (root in a user namespace included): empty bounding set, the
    securebits that stop uid 0 from regaining them, empty capability sets."""
    for cap in range(64):
        if _prctl(libc, 24, cap) != 0:  # PR_CAPBSET_DROP: EINVAL past the last capability, EPERM without SETPCAP
            break
    _prctl(libc, 47, 4)  # PR_CAP_AMBIENT_CLEAR_ALL
    _prctl(libc, 28, 0xCF)  # PR_SET_SECUREBITS: NOROOT, NO_SETUID_FIXUP, NO_CAP_AMBIENT_RAISE and their locks
    header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if libc.capset(ctypes.create_string_buffer(header, 8), ctypes.create_string_buffer(bytes(24), 24)) != 0:
        raise _error("cannot drop capabilities")
    with open("/proc/self/status", encoding="utf-8") as handle:
        status = dict(line.split(":", 1) for line in handle if ":" in line)
    if int(status.get("CapEff", "0").strip(), 16) or int(status.get("CapPrm", "0").strip(), 16):
        raise SetupError("capabilities are still held after dropping them")


def landlock(libc: ctypes.CDLL, abi: int, workdir: str, *, reads: bool) -> None:
    """A Landlock domain: writes only under ``workdir`` (and ``/dev/null``); from ABI 4 no TCP, from ABI 6
    no abstract Unix socket or signal out of the domain. With ``reads``, files under ``/proc`` are readable
    only for this process (so no other process's environment, command line or memory), all else stays readable.
    A domain also refuses ptrace of any process outside it."""
    write = sum(1 << bit for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))
    write |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)
    read_file = (1 << 2) if reads else 0
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    attr = struct.pack("QQQ", write | read_file, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)[:size]
    ruleset = libc.syscall(444, ctypes.create_string_buffer(attr, size), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise _error("landlock")
    rules = [(workdir, write | read_file, True), ("/dev/null", 2 | (1 << 14 if abi >= 3 else 0) | read_file, True)]
    if reads:
        rules += [("/" + name, read_file, False) for name in sorted(os.listdir("/")) if name != "proc"]
        rules += [("/proc/" + name, read_file, False) for name in sorted(os.listdir("/proc"))
                  if not name.isdigit() and name not in ("self", "thread-self")]
        rules.append((f"/proc/{os.getpid()}", read_file, True))
    try:
        for path, access, required in rules:
            try:
                where = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                if required:
                    raise
                continue  # a dangling link under / or a /proc entry that went away
            rule = ctypes.create_string_buffer(struct.pack("=Qi", access, where), 12)
            added = libc.syscall(445, ctypes.c_int(ruleset), ctypes.c_int(1), rule, ctypes.c_uint32(0))
            os.close(where)
            if added != 0 and required:
                raise _error(f"landlock rule for {path}")
        if _prctl(libc, 38, 1) != 0 or libc.syscall(446, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise _error("landlock")
    finally:
        os.close(ruleset)


class _Filter:
    """A classic-BPF program with forward jumps to labels, resolved at the end."""

    LD, JEQ, JGE, JA, AND, RET = 0x20, 0x15, 0x35, 0x05, 0x54, 0x06

    def __init__(self) -> None:
        self.code: list[tuple[int, object, object, object]] = []
        self.labels: dict[str, int] = {}

    def add(self, op: int, k: object = 0, jt: object = 0, jf: object = 0) -> None:
        self.code.append((op, jt, jf, k))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def assemble(self) -> bytes:
        out = bytearray()
        for at, (op, jt, jf, k) in enumerate(self.code):
            offset = lambda x: self.labels[x] - at - 1 if isinstance(x, str) else x  # noqa: E731
            jt, jf = offset(jt), offset(jf)
            k = offset(k) if op == self.JA else k
            if not (0 <= jt <= 255 and 0 <= jf <= 255):
                raise SetupError("seccomp filter: a jump too long")
            out += struct.pack("=HBBI", op, jt, jf, k)
        return bytes(out)


def seccomp_program(machine: str, protected: list[int]) -> bytes:
    """The filter: no socket but stream socket pairs (so no network, UDP included, and no Unix socket of the
    host, file or abstract), no io_uring (which could open sockets past the filter), no ptrace or access to
    other processes' memory or files, and no signal to a ``protected`` pid (the harness, the evaluator) or to
    every process (-1); a refused call fails with EPERM. Other architectures' calls are refused."""
    arch, nr = ARCHES[machine]
    deny, allow = 0x00050000 | 1, 0x7FFF0000  # SECCOMP_RET_ERRNO | EPERM, SECCOMP_RET_ALLOW
    arg = lambda n, high=False: 16 + 8 * n + (4 if high else 0)  # noqa: E731 (little-endian halves of args[n])
    f = _Filter()
    f.add(f.LD, 4)
    f.add(f.JEQ, arch, 1, 0)
    f.add(f.RET, deny)
    f.add(f.LD, 0)
    if machine == "x86_64":
        f.add(f.JGE, 0x40000000, 0, 1)  # the x32 ABI
        f.add(f.RET, deny)
    for name in ("socket", "connect", "io_uring_setup", "io_uring_enter", "io_uring_register", "ptrace",
                 "process_vm_readv", "process_vm_writev", "pidfd_getfd", "pidfd_open", "pidfd_send_signal", "tkill"):
        f.add(f.JEQ, nr[name], 0, 1)
        f.add(f.RET, deny)
    for name in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        f.add(f.JEQ, nr[name], 0, 2)
        f.add(f.LD, arg(0))
        f.add(f.JA, "pids")
    f.add(f.JEQ, nr["socketpair"], 0, "after-socketpair")  # stream and seqpacket pairs cannot address anyone
    f.add(f.LD, arg(1))
    f.add(f.AND, 0xF)
    f.add(f.JEQ, 1, "allow", 0)
    f.add(f.JEQ, 5, "allow", "deny")
    f.label("after-socketpair")
    f.add(f.JEQ, nr["sendto"], 0, "after-sendto")  # sendto with an address
    f.add(f.LD, arg(4))
    f.add(f.JEQ, 0, 0, "deny")
    f.add(f.LD, arg(4, high=True))
    f.add(f.JEQ, 0, "allow", "deny")
    f.label("after-sendto")
    f.add(f.JEQ, nr["fcntl"], 0, "after-fcntl")  # F_SETOWN, F_SETOWN_EX: SIGIO to another process
    f.add(f.LD, arg(1))
    f.add(f.JEQ, 8, "deny", 0)
    f.add(f.JEQ, 15, "deny", "allow")
    f.label("after-fcntl")
    f.add(f.JEQ, nr["ioctl"], 0, "allow")  # FIOSETOWN, SIOCSPGRP: the same through ioctl
    f.add(f.LD, arg(1))
    f.add(f.JEQ, 0x8901, "deny", 0)
    f.add(f.JEQ, 0x8902, "deny", "allow")
    f.label("allow")
    f.add(f.RET, allow)
    f.label("deny")
    f.add(f.RET, deny)
    f.label("pids")
    for pid in sorted({p & 0xFFFFFFFF for p in [*protected, -1] if p}):
        f.add(f.JEQ, pid, 0, 1)
        f.add(f.RET, deny)
    f.add(f.RET, allow)
    return f.assemble()


def install_seccomp(libc: ctypes.CDLL, protected: list[int]) -> None:
    machine = os.uname().machine
    if machine not in ARCHES:
        raise SetupError(f"seccomp: no filter for {machine}")
    program = seccomp_program(machine, protected)
    buffer = ctypes.create_string_buffer(program, len(program))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(program) // 8, ctypes.addressof(buffer))
    if _prctl(libc, 38, 1) != 0 or libc.prctl(ctypes.c_int(22), ctypes.c_ulong(2), ctypes.byref(fprog),
                                               ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        raise _error("seccomp")


def children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid``: from ``/proc/<pid>/task/*/children`` where the kernel has it, else from
    every ``/proc/*/stat``."""
    try:
        found = set()
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", "rb") as handle:
                found.update(int(child) for child in handle.read().split())
        return sorted(found)
    except OSError:
        pass
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def kill_descendants(budget: float = 3.0) -> bool:
    """SIGKILL every descendant: this process is their subreaper (or PID 1), so orphans, ``setsid`` ones
    included, come back to it until none is left. False when some were still there after ``budget`` seconds
    (or there is no /proc to find them)."""
    me, end = os.getpid(), time.monotonic() + budget
    while time.monotonic() < end and os.path.isdir("/proc"):
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        children = children_of(me)
        if not children:
            return True
        for child in children:
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
        time.sleep(0.002)
    return False


# ------------------------------------------------------------------------------------------- values
def encode(value: object) -> list:
    """A value as tagged JSON data: None, bool, int, float, complex, str, bytes, bytearray, list, tuple,
    dict, set, frozenset (subclasses as their base type; a NumPy scalar as its Python value)."""
    if value is None:
        return ["N"]
    if isinstance(value, bool):
        return ["B", bool(value)]
    if isinstance(value, int):
        return ["I", hex(int.__index__(value))]
    if isinstance(value, float):
        return ["F", float.hex(float.__float__(value))]
    if isinstance(value, complex):
        return ["C", float.hex(complex.real.__get__(value)), float.hex(complex.imag.__get__(value))]
    if isinstance(value, str):
        return ["S", str.__str__(value)]
    if isinstance(value, (bytes, bytearray)):
        return ["Y" if isinstance(value, bytes) else "A", bytes(value).hex()]
    for kind, tag in ((list, "L"), (tuple, "T"), (set, "E"), (frozenset, "Z")):
        if isinstance(value, kind):
            return [tag, [encode(item) for item in kind.__iter__(value)]]
    if isinstance(value, dict):
        return ["D", [[encode(k), encode(v)] for k, v in dict.items(value)]]
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) == ():
        return encode(item())
    raise TypeError(f"a {type(value).__name__} cannot pass between the program and its checks")


def decode(data: object) -> object:
    """The value of :func:`encode`'s data; anything else is a ValueError (never code, never a custom type)."""
    if not isinstance(data, list) or not data or not isinstance(data[0], str):
        raise ValueError("malformed value")
    tag, rest = data[0], data[1:]
    scalars = {"B": (bool, lambda x: x), "I": (str, lambda x: int(x, 16)), "F": (str, float.fromhex),
               "S": (str, lambda x: x), "Y": (str, bytes.fromhex), "A": (str, lambda x: bytearray.fromhex(x))}
    if tag == "N" and not rest:
        return None
    if tag in scalars and len(rest) == 1 and isinstance(rest[0], scalars[tag][0]):
        return scalars[tag][1](rest[0])
    if tag == "C" and len(rest) == 2 and all(isinstance(x, str) for x in rest):
        return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
    containers = {"L": list, "T": tuple, "E": set, "Z": frozenset}
    if tag in containers and len(rest) == 1 and isinstance(rest[0], list):
        return containers[tag](decode(item) for item in rest[0])
    if tag == "D" and len(rest) == 1 and isinstance(rest[0], list):
        if not all(isinstance(pair, list) and len(pair) == 2 for pair in rest[0]):
            raise ValueError("malformed dict")
        return {decode(k): decode(v) for k, v in rest[0]}
    raise ValueError(f"malformed value with tag {tag!r}")


def _send(fd: int, message: dict) -> None:
    view = memoryview((json.dumps(message) + "\n").encode("utf-8"))
    while view:
        view = view[os.write(fd, view):]


class _Lines:
    """JSON messages, one a line, from the program's process: at most ``cap`` bytes a line, read until
    ``deadline``; end of file, or the process's exit, ends them (a descendant may hold the pipe open)."""

    def __init__(self, fd: int, process: subprocess.Popen, deadline: float, cap: int) -> None:
        self.fd, self.process, self.deadline, self.cap = fd, process, deadline, cap
        self.buffer, self.closed = bytearray(), False

    def _read(self, wait: float) -> bool:
        """Read what arrives within ``wait`` seconds; False when nothing did."""
        if not select.select([self.fd], [], [], wait)[0]:
            return False
        chunk = os.read(self.fd, 1 << 16)
        self.closed = not chunk
        self.buffer += chunk
        if len(self.buffer) > self.cap:
            raise ProtocolError(f"the program sent more than {self.cap} bytes in one answer")
        return True

    def next(self) -> dict | None:
        """The next message, None at the end."""
        while b"\n" not in self.buffer:
            if self.closed:
                return None
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise Deadline
            if not self._read(min(left, 0.05)) and self.process.poll() is not None:
                while not self.closed and b"\n" not in self.buffer and self._read(0):
                    pass
                self.closed = True
        line, _, rest = bytes(self.buffer).partition(b"\n")
        self.buffer = bytearray(rest)
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            raise ProtocolError("the program sent a malformed message")
        return message


# ------------------------------------------------------------------------------------------ harness
class Program:
    """The checks' handle on the program: ``program.function("add")(2, 3)`` calls ``add`` in the program's
    process with copies of the arguments and returns a copy of its result (:func:`encode`)."""

    def __init__(self, requests: int, answers: _Lines) -> None:
        self._requests, self._answers, self.ended = requests, answers, False

    def function(self, name: str):
        return lambda *args, **kwargs: self._call({"op": "call", "name": name}, args, kwargs)

    def method(self, cls: str, name: str):
        """``Solution().name`` on a fresh instance per call."""
        return lambda *args, **kwargs: self._call({"op": "method", "cls": cls, "name": name}, args, kwargs)

    def _call(self, request: dict, args: tuple, kwargs: dict) -> object:
        if self.ended:
            raise ProgramEnded
        try:
            _send(self._requests, {**request, "args": encode(list(args)), "kwargs": encode(kwargs)})
            answer = self._answers.next()
        except OSError:  # the program closed its end
            answer = None
        if answer is None:
            self.ended = True
            raise ProgramEnded
        if isinstance(answer.get("raise"), list):
            name, text = [str(x) for x in (answer["raise"] + ["", ""])[:2]]
            kind = getattr(builtins, name, None)
            kind = kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError
            raise kind(f"{name}: {text}" if kind is RuntimeError else text)
        try:
            return decode(answer.get("value"))
        except (ValueError, TypeError, RecursionError) as err:  # TypeError: an unhashable key
            raise ProtocolError(f"the program's answer is malformed: {err}") from None


def _wait(process: subprocess.Popen, deadline: float) -> int:
    left = deadline - time.monotonic()
    if left <= 0:
        raise Deadline
    try:
        return process.wait(timeout=left)
    except subprocess.TimeoutExpired:
        raise Deadline from None


def _drive(setup: dict, process: subprocess.Popen, answers: _Lines, requests: int, deadline: float) -> dict:
    """Follow the program (and run its checks): the verdict without nonce."""
    if answers.next() is None:  # it ended before its containment was in place
        code = _wait(process, deadline)
        return {"status": "sandbox" if code == SETUP_FAILED else "ended", "returncode": code}
    if setup["mode"] == "script":
        end = False
        while (message := answers.next()) is not None:
            end = end or message.get("end") is True
        return {"status": "exited", "returncode": _wait(process, deadline), "completed": end}
    if (answers.next() or {}).get("ready") is not True:  # ended before the end of its code
        return {"status": "ended", "returncode": _wait(process, deadline)}
    program, output = Program(requests, answers), io.StringIO()
    try:
        with contextlib.redirect_stdout(output):
            exec(compile(setup.get("checks") or "", "checks.py", "exec", dont_inherit=True),
                 {"__name__": "__checks__", "program": program})
    except ProgramEnded:
        pass
    except Exception as err:  # a failed check: its traceback goes to stderr
        traceback.print_exc()
        sys.stderr.flush()
        return {"status": "failed", "error": type(err).__name__, "output": output.getvalue()}
    if program.ended:
        return {"status": "ended", "returncode": _wait(process, deadline)}
    os.close(requests)  # the program's server ends at end of file
    return {"status": "ok", "returncode": _wait(process, deadline), "output": output.getvalue()}


def _contain(setup: dict, libc: ctypes.CDLL, workdir: str) -> None:
    if setup["namespaces"]:
        read_only_mounts(libc, workdir)
    drop_capabilities(libc)
    _prctl(libc, 38, 1)  # PR_SET_NO_NEW_PRIVS: no setuid or file capability raises the program's rights
    _prctl(libc, 36, 1)  # PR_SET_CHILD_SUBREAPER: orphaned descendants come back to the harness
    _prctl(libc, 4, 0)  # PR_SET_DUMPABLE 0: the program cannot read this process's memory or files in /proc
    if not setup["namespaces"]:
        _prctl(libc, 1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the evaluator died, clean up
    if setup["landlock"]:
        landlock(libc, setup["landlock"], workdir, reads=False)
    if setup["seccomp"]:
        install_seccomp(libc, [os.getpid(), -os.getpgid(0), *setup["protected"]])  # pgid 0: not in this namespace


def harness(setup_path: str, verdict_fd: int) -> int:
    with open(setup_path, encoding="utf-8") as handle:
        setup = json.load(handle)
    os.remove(setup_path)  # read before the program starts: it never sees the checks
    verdict: dict = {"nonce": setup["nonce"], "status": "sandbox"}
    deadline = setup["deadline"]
    expired = []

    def on_alarm(*_: object) -> None:
        expired.append(True)
        raise Deadline

    def on_term(*_: object) -> None:
        raise Stopped

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_term)
    workdir = os.getcwd()
    try:
        signal.setitimer(signal.ITIMER_REAL, max(1e-3, deadline - time.monotonic()))
        try:
            libc = _libc() if sys.platform.startswith("linux") else None
            if libc is not None:
                _contain(setup, libc, workdir)
        except (SetupError, OSError) as err:
            os.write(2, f"tadm sandbox: {err}\n".encode())
            verdict["error"] = str(err)
            return SETUP_FAILED
        requests_read, requests = os.pipe()
        answers_fd, answers_write = os.pipe()
        command = [sys.executable, "-I", "-B", os.path.abspath(__file__), "program", setup["mode"],
                   str(requests_read), str(answers_write), str(setup["landlock"])]
        process = subprocess.Popen(command, pass_fds=(requests_read, answers_write), start_new_session=True)
        os.close(requests_read)
        os.close(answers_write)
        cap = max(1 << 20, setup["memory_mb"] << 18)
        verdict.update(_drive(setup, process, _Lines(answers_fd, process, deadline, cap), requests, deadline))
        if expired:  # the checks swallowed the deadline
            verdict.update(status="timeout")
    except Deadline:
        verdict.update(status="timeout")
    except Stopped:
        verdict.update(status="stopped")
    except ProtocolError as err:
        os.write(2, f"tadm sandbox: {err}\n".encode())
        verdict.update(status="failed", error="ProtocolError")
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM})  # nothing interrupts the end
        signal.setitimer(signal.ITIMER_REAL, 0)
        verdict["clean"] = kill_descendants()
        verdict["output"] = str(verdict.get("output", ""))[: setup["max_output"]]
        with contextlib.suppress(OSError):
            _send(verdict_fd, verdict)
    return 0


# ------------------------------------------------------------------------------------------ program
def _no_network(*args: object, **kwargs: object) -> None:
    raise OSError(NETWORK_ERROR)


def _serve(names: dict, requests: int, answers: int) -> None:
    with os.fdopen(requests, "rb") as reader:
        for line in reader:
            message = json.loads(line)
            try:
                if message.get("op") == "method":
                    target = getattr(names[message["cls"]](), message["name"])
                elif message["name"] in names:
                    target = names[message["name"]]
                else:
                    raise NameError(f"name {message['name']!r} is not defined")
                answer = {"value": encode(target(*decode(message["args"]), **decode(message["kwargs"])))}
            except Exception as err:
                try:
                    text = str(err)[:2000]
                except Exception:
                    text = ""
                answer = {"raise": [type(err).__name__, text]}
            _send(answers, answer)


def program(mode: str, requests: int, answers: int, abi: int) -> None:
    workdir = os.getcwd()
    try:
        if sys.platform.startswith("linux"):
            libc = _libc()
            _prctl(libc, 1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the harness went, so does the program
            if abi:
                landlock(libc, abi, workdir, reads=True)
    except (SetupError, OSError) as err:
        os.write(2, f"tadm sandbox: {err}\n".encode())
        os._exit(SETUP_FAILED)
    for fd in (requests, answers):
        os.set_inheritable(fd, False)  # not passed to what the program executes
    _send(answers, {"setup": True})
    socket.socket.__init__ = _no_network  # a clear message first; the seccomp filter holds below Python
    for name in ("create_connection", "create_server", "getaddrinfo", "socketpair", "fromfd"):
        setattr(socket, name, _no_network)
    with open("program.py", encoding="utf-8") as handle:
        source = handle.read()
    module = types.ModuleType("__main__")
    module.__file__ = "program.py"
    sys.modules["__main__"], sys.argv = module, ["program.py"]
    try:
        exec(compile(source, "program.py", "exec", dont_inherit=True), module.__dict__)
    except SystemExit as stop:
        if mode != "script" or stop.code not in (0, None):
            raise
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            os._exit(1)
    if mode == "script":
        _send(answers, {"end": True})
    else:
        _send(answers, {"ready": True})
        _serve(module.__dict__, requests, answers)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    os._exit(0)


def main(argv: list[str]) -> int:
    if argv[0] == "harness":
        return harness(argv[1], int(argv[2]))
    program(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
