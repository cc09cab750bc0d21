"""POSIX shared memory for a service on the engine's host: files under /dev/shm, as shm_open makes them.

The engine makes a segment (owner-only, its space reserved when it is made: a full /dev/shm fails here, not as
SIGBUS on a later write) and names it to the service, which maps it; the engine unlinks the name once the service
has it, so only the two mappings keep it and nothing else can open it. Used for the sampler's logits slots
(mesh/sampler/slots.py) and the kvstore's Get (mesh/kvstore/client.py).
"""

import mmap
import os
import re
import secrets

SHM_DIR = "/dev/shm"


def create_segment(prefix: str, size: int) -> tuple[str, mmap.mmap]:
    """A new segment `prefix`-<32 hex digits> of `size` bytes and the engine's mapping of it; OSError when it cannot
    be had (no /dev/shm, or not enough room in it)."""
    name = f"{prefix}-{secrets.token_hex(16)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        return name, mmap.mmap(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def is_segment_name(name: str, prefix: str) -> bool:
    """Whether name has the form create_segment(prefix, ...) gives it (no path: nothing outside /dev/shm)."""
    return re.fullmatch(rf"{re.escape(prefix)}-[0-9a-f]{{32}}", name) is not None


def open_segment(name: str) -> mmap.mmap:
    """A service's mapping of a segment (the caller has checked is_segment_name); OSError when it cannot be opened
    here, ValueError when it is not this user's private segment."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError("the segment must be owned by this user and private to it (mode 0600)")
        if not st.st_size:
            raise ValueError("the segment is empty")
        return mmap.mmap(fd, st.st_size)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> None:
    """Remove the name (the mappings stay)."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
