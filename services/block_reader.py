"""KV block values out of Redis straight into a caller's buffer: pipelined MGETs on a connection of their own,
each value's header and checksum read first and its data received in place (socket.recv_into).

redis-py's MGET parses every value into a bytes object of its own, and that parse, not Redis's sending, bounds
it; received in place, Redis's own sending is the limit. MGET, not one GET a block: Redis evicts
before each command, and under maxmemory a GET's reply waiting to be read would evict the next blocks asked for.
A Get holds its connection for its reads alone, opened when it starts: no pooled connection can be stale after a
Redis restart.
"""

import socket
import ssl
from collections.abc import Callable

from redis.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

_LINE_READ = 4096  # bytes a header line is read by: a little of the data comes along, no more


def command(*args: bytes) -> bytes:
    """One command in Redis's protocol (RESP)."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class BlockReader:
    """One Get's reads: send(keys) pipelines an MGET of them, read_values() starts its reply and read_value() takes
    its values in order. Any fault raises OSError or a redis-py error; once a Get stops short of the replies it asked
    for, the connection is closed."""

    def __init__(self, url: str, timeout: float, ssl_context: ssl.SSLContext | None = None):
        where = parse_url(url)
        self.sock = socket.create_connection((where.get("host", "localhost"), where.get("port", 6379)), timeout)
        self.buffer = bytearray()
        setup = []
        if "password" in where:
            user = [where["username"].encode()] if where.get("username") else []
            setup.append(command(b"AUTH", *user, where["password"].encode()))
        if where.get("db"):
            setup.append(command(b"SELECT", str(where["db"]).encode()))
        try:
            if url.startswith("rediss://"):
                context = ssl_context or ssl.create_default_context()
                self.sock = context.wrap_socket(self.sock, server_hostname=where.get("host"))
            if setup:
                self.sock.sendall(b"".join(setup))
                for _ in setup:
                    if not (reply := self._line()).startswith(b"+"):
                        raise ResponseError(reply[1:].decode(errors="replace"))
        except BaseException:
            self.sock.close()
            raise

    def send(self, keys: list[str]) -> None:
        self.sock.sendall(command(b"MGET", *(key.encode() for key in keys)))

    def read_values(self, count: int) -> None:
        """Start the next MGET's reply, which must hold count values."""
        line = self._line()
        if line[:1] == b"-":
            raise ResponseError(line[1:].decode(errors="replace"))
        if line != b"*%d" % count:
            raise RedisConnectionError(f"Redis answered {line[:40]!r} to an MGET of {count} keys")

    def read_value(self, prefix_bytes: int, into: memoryview, check: Callable[[bytes, memoryview], bool]) -> str:
        """Take the MGET's next value: prefix_bytes (its header) and len(into) bytes of data, the data received into
        `into`. "ok" when check(header, data) passes, "missing" for no value (or one of another type), "damaged" for
        a value of another size (left unread: the Get stops there) or one that fails the check."""
        line = self._line()
        if line[:1] != b"$":
            raise RedisConnectionError(f"Redis answered {line[:40]!r} for a value of an MGET")
        size = int(line[1:])
        if size < 0:
            return "missing"
        if size != prefix_bytes + len(into):
            return "damaged"
        prefix = self._exact(prefix_bytes)
        self._receive_into(into)
        self._exact(2)  # the reply's \r\n
        return "ok" if check(prefix, into) else "damaged"

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a read still blocked on another thread
        except OSError:
            pass
        self.sock.close()

    # ---- the socket ---------------------------------------------------------------------------------

    def _fill(self) -> None:
        chunk = self.sock.recv(_LINE_READ)
        if not chunk:
            raise RedisConnectionError("Redis closed the connection")
        self.buffer += chunk

    def _line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    def _exact(self, n: int) -> bytes:
        while len(self.buffer) < n:
            self._fill()
        out = bytes(self.buffer[:n])
        del self.buffer[:n]
        return out

    def _receive_into(self, into: memoryview) -> None:
        taken = min(len(into), len(self.buffer))
        into[:taken] = self.buffer[:taken]
        del self.buffer[:taken]
        while taken < len(into):
            n = self.sock.recv_into(into[taken:])
            if not n:
                raise RedisConnectionError("Redis closed the connection")
            taken += n
