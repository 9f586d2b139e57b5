"""loadtest.tpu_bench.RawConnection, the bench's light HTTP/1.1 client over a unix socket, against
a real asyncio server on one: answers of a content-length and of chunks, kept alive, and a
connection the server closes opened again for the next request."""

from __future__ import annotations

import asyncio
import json

from loadtest.tpu_bench import RawConnection


async def _serve(path: str, seen: list[bytes]) -> asyncio.AbstractServer:
    answers = [
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 9\r\n\r\n" + b'{"n": 1} ',
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"n\"\r\n4;x=y\r\n: 2}\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\nConnection: close\r\n\r\n" + b'{"n": 3}',
        b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}",
    ]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"content-length"))
            seen.append(head.split(b"\r\n")[0] + b" " + await reader.readexactly(length))
            answer = answers[len(seen) - 1]
            writer.write(answer)
            await writer.drain()
            if b"close" in answer:
                break
        writer.close()

    return await asyncio.start_unix_server(handle, path)


def test_a_raw_connection_reads_each_kind_of_answer_and_reconnects(tmp_path):
    path, seen = str(tmp_path / "s.sock"), []

    async def run() -> list[tuple[int, bytes]]:
        server = await _serve(path, seen)
        own = RawConnection(path)
        try:
            return [await own.post("/v1/completions", json.dumps({"i": i}).encode()) for i in range(4)]
        finally:
            await own.close()
            server.close()

    answers = asyncio.run(run())
    assert answers == [(200, b'{"n": 1} '), (201, b'{"n": 2}'), (200, b'{"n": 3}'), (400, b"{}")]
    assert seen == [b'POST /v1/completions HTTP/1.1 {"i": %d}' % i for i in range(4)]
