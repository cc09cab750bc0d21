"""The step channel: each step's message and its answer over a Unix socket, for a sampler on the engine's host.

Once a sampler service has taken the engine's shared-memory slots, a step's message is small (the slot, the
rows' ids and new tokens), and what a step costs is the passing of two gRPC messages through the threads on
each side. Over this socket the engine thread writes the message itself and waits in the kernel for the answer
(the GIL released), and the service answers from a thread of its own blocked in the same way.

The engine makes the socket in a new owner-only directory, names it in the shared-memory offer, and removes the
name and the directory once the service has answered: the service connects and writes the offer's token first,
so the engine knows it talks to the process it made the offer to. Each message is a frame of engine.framing (a
4-byte little-endian length, then the protobuf). A sampler that dies closes its end: the engine's wait ends at
once (EOF), not at the deadline.

A greedy step, whose rows all take the argmax of their raw logits (engine.sample.metadata.argmax_only), is a fixed
frame instead: its length has bit 31 set, and it holds the step id, the slot and its generation, the logits' dtype
(an index into GREEDY_DTYPES) and shape. Both ends send and answer it outside their interpreters
(kernels/cpu/greedy_steps.cpp, which has the layout); the answer is the step id and each row's token, 8 bytes each.
A sampled step, whose rows are shaped by temperature, min-p, top-k and top-p alone
(engine.sample.metadata.plain_sampling), is the same frame with bit 30 set instead and each row's settings after it,
sampled there as the Sampler samples it and answered alike. The service says in the offer's answer
(SampleResult.greedy_steps) whether it takes both.
"""

import os
import re
import shutil
import socket
import tempfile
import time

import torch

from engine.framing import FRAME_LENGTH, check_frame_length, frame

GREEDY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DIR_PREFIX = "llmmesh-step-"
_SOCKET_NAME = "step"
_PATH = re.compile(r"(/[^/\0]+)*/" + _DIR_PREFIX + r"[a-z0-9_]{8}/" + _SOCKET_NAME)


class ChannelClosedError(Exception):
    """The other end closed the channel (its process ended, or it gave up on the stream)."""


class StepChannel:
    """One connected end: send() a message, recv() the other end's; at most engine.framing.MAX_MESSAGE_BYTES each."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buffer = bytearray(64 * 1024)

    def send(self, data: bytes, timeout: float | None = None) -> None:
        data = frame(data)  # ValueError over the limit, before anything is sent
        self.sock.settimeout(timeout)
        self.sock.sendall(data)

    def recv(self, timeout: float | None = None, length: int | None = None) -> memoryview:
        """The next message (valid until the next recv); TimeoutError past `timeout` seconds, ChannelClosedError
        when the other end closed, ValueError for a length over the limit. length: the message's, when its 4 bytes
        were read already (by the service's greedy steps)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if length is None:
            self._read_into(memoryview(self._buffer)[: FRAME_LENGTH.size], deadline)
            (length,) = FRAME_LENGTH.unpack_from(self._buffer)
        check_frame_length(length)
        # A large message (prompt logits) gets a buffer of its own, not kept once read.
        buffer = self._buffer if length <= len(self._buffer) else bytearray(length)
        view = memoryview(buffer)[:length]
        self._read_into(view, deadline)
        return view

    def _read_into(self, view: memoryview, deadline: float | None) -> None:
        got = 0
        while got < len(view):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            try:
                n = self.sock.recv_into(view[got:])
            except ConnectionResetError:
                n = 0
            if not n:
                raise ChannelClosedError
            got += n

    def close(self) -> None:
        """Wake a thread blocked in recv() on this end (it sees the channel closed) and close the socket."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more
            pass
        self.sock.close()


class ChannelListener:
    """The engine's side before the service connects: the socket's name, in a directory only this user can enter."""

    def __init__(self):
        self.directory = tempfile.mkdtemp(prefix=_DIR_PREFIX)  # mode 0700
        self.path = os.path.join(self.directory, _SOCKET_NAME)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(self.path)
            self.sock.listen(1)
        except BaseException:
            self.close()
            raise

    def accept(self, token: bytes, timeout: float) -> StepChannel:
        """The service's connection (made before it answered the offer); ValueError when its first bytes are not
        the token."""
        self.sock.settimeout(timeout)
        conn, _ = self.sock.accept()
        channel = StepChannel(conn)
        try:
            got = bytearray(len(token))
            channel._read_into(memoryview(got), time.monotonic() + timeout)
            if bytes(got) != token:
                raise ValueError("the step channel's peer did not write the offer's token")
        except BaseException:
            channel.close()
            raise
        return channel

    def close(self) -> None:
        """Remove the name and its directory: a connected channel stays, nothing new can connect."""
        self.sock.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def connect(path: str, token: bytes, timeout: float = 5.0) -> StepChannel:
    """The service's side: connect to the engine's socket and write the token; ValueError when the path is not
    an engine's step socket in a directory private to this user, OSError when it cannot be reached."""
    if not _PATH.fullmatch(path) or os.path.normpath(path) != path:
        raise ValueError(
            f"step_socket must be an absolute path ending in /{_DIR_PREFIX}<8 characters>/{_SOCKET_NAME}, got {path[:128]!r}"
        )
    st = os.stat(os.path.dirname(path), follow_symlinks=False)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError("step_socket's directory must be owned by this user and private to it (mode 0700)")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(token)
    except BaseException:
        sock.close()
        raise
    return StepChannel(sock)
