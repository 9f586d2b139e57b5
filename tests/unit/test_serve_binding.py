"""`pathserve serve` binds before it says it listens or loads anything: a port in use, a host that
does not resolve, a unix socket path it cannot take are exit status 2 with one line naming the flag
(they were exit 3 after "listening on ...", or a traceback for --uds)."""

from __future__ import annotations

import socket

import pytest

from tests.cli import call_cli


@pytest.fixture
def taken_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def test_a_port_in_use_is_exit_2_naming_it(taken_port):
    result = call_cli("serve", "--port", str(taken_port), "grpc_port=0")
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on --host 127.0.0.1 --port {taken_port}" in result.stderr
    assert "listening on" not in result.stderr and "Traceback" not in result.stderr


def test_a_host_that_does_not_resolve_is_exit_2():
    result = call_cli("serve", "--host", "no-such-host.invalid", "--port", "18931", "grpc_port=0")
    assert result.returncode == 2 and "cannot listen on --host no-such-host.invalid" in result.stderr, result.stderr


def test_a_unix_socket_path_it_cannot_take_is_exit_2(tmp_path):
    missing = tmp_path / "no" / "dir" / "s.sock"
    taken = tmp_path / "a-file"
    taken.write_text("x")
    for path in (missing, taken):
        result = call_cli("serve", "--uds", str(path), "grpc_port=0")
        assert result.returncode == 2 and f"cannot listen on --uds {path}" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert taken.read_text() == "x"  # left as it was
