"""Writing a large dataset's bytes straight to the disk (``O_DIRECT``) at its offset in the rank file.

Why: a durable write through the page cache first copies every byte into freshly allocated cache
pages (on many hosts the slowest part of a checkpoint, and CPU taken from training), then writes them
back at ``fsync``. A direct write goes from the caller's memory to the device and leaves no dirty
pages behind. HDF5 still owns the file's layout and metadata: the dataset is allocated (aligned to
``BLOCK``) by HDF5, which never writes its data, and only whole blocks inside it are written here; the
unaligned tail goes through the page cache. Where ``O_DIRECT`` is refused (tmpfs, some network file
systems) every byte goes through the page cache, by ``pwrite``, and nothing else changes.
"""
from __future__ import annotations

import errno
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

BLOCK = 4096  # alignment of offsets, lengths and memory for O_DIRECT on every common device
MIN_DIRECT_BYTES = 1 << 20  # smaller datasets are written by HDF5 (alignment would waste space)
PIECE = 16 << 20  # bytes per write call; also the size of the bounce buffer for unaligned memory
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def pwrite_all(fd: int, data: memoryview | np.ndarray, offset: int) -> None:
    """``pwrite`` until every byte of ``data`` is at ``offset``."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {n} bytes")
        view, offset = view[n:], offset + n


def _alignment(address: int) -> int:
    """The largest power of two dividing ``address`` (BLOCK at most)."""
    return min(address & -address, BLOCK) if address else BLOCK


class DirectWriter:
    """Writes byte ranges into existing files, directly where the file system allows it. One per
    writer (it owns the bounce buffers for memory the device will not take, and remembers what each
    device took); not thread-safe."""

    def __init__(self):
        self._bounce: tuple[np.ndarray, np.ndarray] | None = None
        self.direct_bytes = 0  # bytes that bypassed the page cache (for tests and benchmarks)
        self.cpu_seconds = 0.0  # CPU time of the writing thread inside write() (the checkpointer's trace)
        self._refused: set[int] = set()  # st_dev of file systems that refused O_DIRECT
        self._accepted: set[int] = set()  # ... and of those that took it
        self._memory_taken: dict[int, int] = {}  # st_dev -> least memory alignment O_DIRECT took there
        self._memory_refused: dict[int, int] = {}  # st_dev -> greatest memory alignment refused there

    def write(self, path: str, offset: int, data: np.ndarray, direct: bool = True) -> None:
        """Write the flat uint8 array ``data`` at byte ``offset`` of the existing file ``path``
        (``direct=False``: every byte through the page cache)."""
        cpu = time.thread_time()
        try:
            aligned = data.size // BLOCK * BLOCK if direct and offset % BLOCK == 0 and _O_DIRECT else 0
            done = self._write_direct(path, offset, data[:aligned]) if aligned else 0
            if done < data.size:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    pwrite_all(fd, data[done:], offset + done)
                finally:
                    os.close(fd)
        finally:
            self.cpu_seconds += time.thread_time() - cpu

    def _write_direct(self, path: str, offset: int, data: np.ndarray) -> int:
        """Bytes of ``data`` (block-aligned length and offset) written with O_DIRECT from the start."""
        dev = os.stat(path).st_dev
        if dev in self._refused:
            return 0
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | _O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._refused.add(dev)
            return 0
        done = 0
        try:
            while done < data.size:
                piece = data[done:done + PIECE]
                how = self._memory_rule(dev, piece.ctypes.data)
                if how == "bounce" and dev in self._accepted:
                    return done + self._write_bounced(fd, offset + done, data[done:])
                if how == "bounce":  # the first piece on this device: is O_DIRECT taken at all?
                    bounce = self._bounce_buffers()[0][:piece.size]
                    np.copyto(bounce, piece)
                    piece = bounce
                try:
                    n = os.pwrite(fd, piece, offset + done)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    align = _alignment(piece.ctypes.data)
                    if how == "try":  # this memory alignment is refused, O_DIRECT is not: bounce it
                        self._memory_refused[dev] = max(self._memory_refused.get(dev, 0), align)
                        continue
                    self._refused.add(dev)  # an alignment this device does not accept: the rest buffered
                    break
                if n <= 0:
                    raise OSError(errno.EIO, f"pwrite wrote {n} bytes")
                if how == "try":
                    self._memory_taken[dev] = min(self._memory_taken.get(dev, BLOCK), _alignment(piece.ctypes.data))
                self._accepted.add(dev)
                done += n
                self.direct_bytes += n
        finally:
            os.close(fd)
        return done

    def _memory_rule(self, dev: int, address: int) -> str:
        """How memory at ``address`` goes to the device ``dev`` with O_DIRECT: straight (``direct``),
        by trying it (``try``: devices differ, NVMe takes memory aligned to 4 bytes, virtio disks to
        512), or through a page-aligned bounce buffer (``bounce``)."""
        align = _alignment(address)
        if align >= self._memory_taken.get(dev, BLOCK):
            return "direct"
        if dev not in self._accepted or align <= self._memory_refused.get(dev, 0):
            return "bounce"
        return "try"

    def _write_bounced(self, fd: int, offset: int, data: np.ndarray) -> int:
        """All of ``data`` (memory not block-aligned: torch's allocations start 64 bytes past a page)
        at ``offset`` of ``fd`` (O_DIRECT), through two bounce buffers: one piece is copied while the
        one before is written by a helper thread, so the copy hides behind the device (a 1 GiB save
        of torch tensors took 1.6x as long as of aligned memory when the two alternated)."""
        buffers, pending = self._bounce_buffers(), []
        cpu: list[float] = []

        def write(piece: np.ndarray, at: int) -> None:
            t = time.thread_time()
            try:
                pwrite_all(fd, piece, at)
            finally:
                cpu.append(time.thread_time() - t)
        with ThreadPoolExecutor(1, "ucl-direct") as io:
            try:
                for k, at in enumerate(range(0, data.size, PIECE)):
                    piece = data[at:at + PIECE]
                    if len(pending) == 2:
                        pending.pop(0).result()  # the write from the buffer about to be refilled
                    bounce = buffers[k % 2][:piece.size]
                    np.copyto(bounce, piece)
                    pending.append(io.submit(write, bounce, offset + at))
                for f in pending:
                    f.result()
            finally:
                for f in pending:
                    f.cancel()
        self.cpu_seconds += sum(cpu)  # the helper's; the caller's own is counted by write()
        self.direct_bytes += data.size
        return data.size

    def _bounce_buffers(self) -> tuple[np.ndarray, np.ndarray]:
        if self._bounce is None:  # anonymous mmaps: page-aligned
            self._bounce = tuple(np.frombuffer(mmap.mmap(-1, PIECE), dtype=np.uint8) for _ in range(2))
        return self._bounce

