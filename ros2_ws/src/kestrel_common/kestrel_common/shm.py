"""Named POSIX shared-memory segments and an aligned-view allocator over them.

Used by the control node's loop process (kestrel_control.core.shm_control) and the perception
node's input receiver processes (kestrel_perception.core.input_rings).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

ALIGN = 64


class Arena:
    """Carves aligned numpy views out of a buffer (None: only computes the total size)."""

    def __init__(self, buf=None) -> None:
        self.buf, self.offset = buf, 0

    def take(self, shape: int | tuple[int, ...], dtype) -> np.ndarray | None:
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start = self.offset
        self.offset = start + (nbytes + ALIGN - 1) // ALIGN * ALIGN
        if self.buf is None:
            return None
        return np.ndarray(shape, dtype=dtype, buffer=self.buf, offset=start)


SHM_DIR = "/dev/shm"


def unlink_segment(name: str) -> None:
    """Remove segment `name`'s file (idempotent): its creator's cleanup, or a child process
    that finds its creator died without it."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


class ShmSegment:
    """A named POSIX shared-memory segment (a file in /dev/shm), mapped read-write.

    Not multiprocessing.shared_memory: there every process that opens a segment (3.11/3.12)
    registers it with a resource-tracker process of its own, which then lingers in the node's
    process group and unlinks the segment when *that* process exits. Here the creator unlinks
    (`unlink()`, idempotent) and the loop process unlinks when it sees its node die.
    """

    def __init__(self, name: str, size: int, create: bool) -> None:
        if "/" in name or not name:
            raise ValueError(f"parameter 'name' = {name!r}: a plain file name")
        self.name, self.size = name, int(size)
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self.size)
            self.buf = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            if create:
                self.unlink()
            raise
        os.close(fd)

    def close(self) -> None:
        """Unmap (BufferError is swallowed while views are alive: the mapping goes with them)."""
        try:
            self.buf.close()
        except BufferError:
            pass

    def unlink(self) -> None:
        unlink_segment(self.name)
