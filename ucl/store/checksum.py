"""Checksums of stored bytes: xxh3-64 of each dataset, plus per-chunk digests for large ones so a
partial read is verified by reading only the chunks it touches (docs/format.md)."""
from __future__ import annotations

import re

import numpy as np
import xxhash

CHECKSUM_ALGO = "xxh3_64"
_CHECKSUM_RE = re.compile(r"^xxh3_64:[0-9a-f]{16}$")


def is_checksum(text) -> bool:
    """``text`` has the form ``xxh3_64:<16 hex digits>``."""
    return isinstance(text, str) and bool(_CHECKSUM_RE.match(text))


def format_checksum(hexdigest: str) -> str:
    return f"{CHECKSUM_ALGO}:{hexdigest}"


def raw_bytes(arr: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes as a flat uint8 view (safe for bool and 0-d)."""
    return arr.reshape(-1).view(np.uint8)


def checksum_of(arr: np.ndarray) -> str:
    """``xxh3_64:<hex>`` of a C-contiguous storage array's bytes."""
    return format_checksum(xxhash.xxh3_64_hexdigest(raw_bytes(arr)))


# Datasets above MIN_CHUNK_BYTES also carry a checksum per chunk of their flat bytes (in their rank
# file, as attributes), so a partial read (one rank's hyperslab) is verified by reading only the
# chunks it touches. Chunks are a power of two of at least MIN_CHUNK_BYTES, at most MAX_CHUNKS per
# dataset: a partial read rounds out by at most 1/1024 of the dataset at each end.
MIN_CHUNK_BYTES = 16 << 10
MAX_CHUNKS = 1024


def chunk_size(nbytes: int) -> int | None:
    """Chunk size in bytes for a dataset of ``nbytes``; None when it is small enough to verify whole."""
    if nbytes <= MIN_CHUNK_BYTES:
        return None
    size = MIN_CHUNK_BYTES
    while size * MAX_CHUNKS < nbytes:
        size *= 2
    return size


def checksums(arr: np.ndarray) -> tuple[str, tuple[int, np.ndarray] | None]:
    """(checksum, (chunk bytes, chunk digests) or None) in one pass over the bytes, chunk by chunk
    while each is in cache."""
    raw = raw_bytes(arr)
    size = chunk_size(raw.size)
    if size is None:
        return format_checksum(xxhash.xxh3_64_hexdigest(raw)), None
    whole, digests = xxhash.xxh3_64(), np.empty(-(-raw.size // size), dtype=np.uint64)
    for k, i in enumerate(range(0, raw.size, size)):
        piece = raw[i:i + size]
        whole.update(piece)
        digests[k] = xxhash.xxh3_64_intdigest(piece)
    return format_checksum(whole.hexdigest()), (size, digests)


class IncrementalChecksum:
    """Checksums (whole and per chunk) of a dataset filled piecewise: hashed on the fly while pieces
    arrive in flat order."""

    def __init__(self, nbytes: int) -> None:
        self.hasher, self.next_flat, self.in_order = xxhash.xxh3_64(), 0, True
        self.size = chunk_size(nbytes)
        self.chunks: list[int] = []
        self.chunk, self.chunk_fill = xxhash.xxh3_64(), 0

    def advance(self, start: int, flat: np.ndarray) -> None:
        if self.in_order and start == self.next_flat:
            raw = raw_bytes(flat)
            self.hasher.update(raw)
            pos = 0
            while self.size and pos < raw.size:
                take = min(self.size - self.chunk_fill, raw.size - pos)
                self.chunk.update(raw[pos:pos + take])
                self.chunk_fill += take
                pos += take
                if self.chunk_fill == self.size:
                    self.chunks.append(self.chunk.intdigest())
                    self.chunk, self.chunk_fill = xxhash.xxh3_64(), 0
            self.next_flat += flat.size
        elif flat.size:
            self.in_order = False  # out of order or overwrite: caller re-reads at close

    def result(self, total: int) -> tuple[str, tuple[int, np.ndarray] | None] | None:
        """(checksum, (chunk bytes, chunk digests) or None) if exactly ``total`` elements arrived
        in order, else None."""
        if not (self.in_order and self.next_flat == total):
            return None
        chunks = self.chunks + ([self.chunk.intdigest()] if self.chunk_fill else [])
        return format_checksum(self.hasher.hexdigest()), \
            ((self.size, np.array(chunks, dtype=np.uint64)) if self.size else None)


def chunk_count(nbytes: int) -> int:
    """How many chunk digests a dataset of ``nbytes`` carries (0 when it is verified whole)."""
    size = chunk_size(nbytes)
    return 0 if size is None else -(-nbytes // size)


def chunk_table_digest(whole: str, chunk_bytes: int, digests: np.ndarray) -> str:
    """``xxh3_64:<hex>`` binding a dataset's whole checksum to its chunk table (chunk size, then each
    digest, little-endian). The manifest records it per dataset, so the digests inside a rank file
    are trusted only when they agree with the manifest: a rank file swapped in from another rank or
    checkpoint, or an edited manifest checksum, fails before any byte is used."""
    h = xxhash.xxh3_64(whole.encode("ascii"))
    h.update(np.int64(chunk_bytes).astype("<i8").tobytes())
    h.update(np.ascontiguousarray(digests, dtype="<u8").tobytes())
    return format_checksum(h.hexdigest())


def checksum_fields(whole: str, chunks: tuple[int, np.ndarray] | None) -> dict[str, str]:
    """A manifest entry's checksum keys: ``checksum`` (the whole dataset) and, for chunked
    datasets, ``chunks`` (:func:`chunk_table_digest`)."""
    return {"checksum": whole} if chunks is None else {"checksum": whole, "chunks": chunk_table_digest(whole, *chunks)}
