"""loadtest.server.free_port never hands out a port twice in one process, even when the kernel
offers the same one again (a server once got one port for HTTP and gRPC)."""

from __future__ import annotations

from typing import ClassVar

import loadtest.server as server


class _Socket:
    """A socket whose bind(port 0) gets the next port of `offers`."""

    offers: ClassVar[list[int]] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, address):
        self.port = _Socket.offers.pop(0)

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_a_port_offered_again_is_skipped(monkeypatch):
    monkeypatch.setattr(server, "_GIVEN", set())
    monkeypatch.setattr(server.socket, "socket", _Socket)
    _Socket.offers = [40001, 40001, 40001, 40002]
    assert [server.free_port(), server.free_port()] == [40001, 40002]


def test_real_ports_in_a_row_are_distinct():
    ports = [server.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
