"""The code sandbox: programs run in a subprocess with time and memory limits, no network, a temporary directory."""

from __future__ import annotations

import os

import pytest

from tadm.tasks.sandbox import NETWORK_ERROR, run_program


def test_a_correct_program_passes_and_reads_stdin():
    result = run_program("print(sum(map(int, input().split())))", stdin="2 3\n", timeout=5)
    assert result.ok and result.stdout == "5\n" and result.returncode == 0


def test_a_wrong_program_fails():
    result = run_program("assert 1 + 1 == 3, 'wrong'", timeout=5)
    assert result.status == "error" and "AssertionError" in result.stderr and result.returncode != 0


def test_an_infinite_loop_times_out():
    result = run_program("while True:\n    pass\n", timeout=1)
    assert result.status == "timeout" and result.seconds < 5


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


def test_files_land_in_a_temporary_directory_that_is_removed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = "import os\nopen('out.txt', 'w').write('x')\nprint(os.getcwd())"
    result = run_program(code, timeout=5)
    assert result.ok
    workdir = result.stdout.strip()
    assert os.path.basename(workdir).startswith("tadm-sandbox-") and not os.path.exists(workdir)
    assert list(tmp_path.iterdir()) == []


def test_the_evaluating_process_is_untouched():
    result = run_program("import os\nos.environ['TADM_SANDBOX_PROBE'] = '1'\nraise SystemExit(3)", timeout=5)
    assert result.status == "error" and result.returncode == 3 and "TADM_SANDBOX_PROBE" not in os.environ


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="timeout"):
        run_program("pass", timeout=0)


def test_the_raw_socket_module_cannot_reach_the_network_where_namespaces_are_allowed():
    """With ``unshare -rn`` even ``_socket`` (past the prelude's block) finds no network."""
    from tadm.tasks.sandbox import _network_namespace_prefix

    if not _network_namespace_prefix():
        pytest.skip("this machine does not allow an unprivileged network namespace")
    code = "import _socket\ns = _socket.socket()\ns.settimeout(2)\ns.connect(('1.1.1.1', 80))\nprint('connected')"
    result = run_program(code, timeout=10)
    assert not result.ok and "connected" not in result.stdout
    assert "unreachable" in result.stderr.lower() or "errno" in result.stderr.lower()
