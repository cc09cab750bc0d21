"""One length-prefixed framing for sockets: the executor's rank connections and the sampler's step channel.

A frame is a 4-byte little-endian length, then that many bytes. A length is at most MAX_MESSAGE_BYTES, so bit 31 is
never set by a length: the step channel sets it to mark its greedy frames (kernels/cpu/greedy_steps.cpp reads and
writes them). Torch-free: the gRPC policy of every service takes its limit from here.
"""

import socket
import struct

FRAME_LENGTH = struct.Struct("<I")
# The one limit on a message, on every link (gRPC, the step channel, the ranks' connections): room for
# whole-vocabulary logprobs, and a bound on what a peer can make a process allocate.
MAX_MESSAGE_BYTES = 64 * 2**20


def frame(data: bytes) -> bytes:
    """data behind its length; ValueError when it is over MAX_MESSAGE_BYTES."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"a message of {len(data)} bytes is over the limit of {MAX_MESSAGE_BYTES}")
    return FRAME_LENGTH.pack(len(data)) + data


def check_frame_length(length: int, limit: int = MAX_MESSAGE_BYTES) -> int:
    """length, or ValueError when it is over limit: checked before anything of that size is read."""
    if length > limit:
        raise ValueError(f"a message length must be at most {limit}, got {length}")
    return length


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(frame(data))


def recv_frame(sock: socket.socket, limit: int = MAX_MESSAGE_BYTES) -> bytes | None:
    """One frame's bytes, or None once the other end has closed; ValueError for one over limit bytes."""
    head = _recv_exactly(sock, FRAME_LENGTH.size)
    if head is None:
        return None
    return _recv_exactly(sock, check_frame_length(FRAME_LENGTH.unpack(head)[0], limit))


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
