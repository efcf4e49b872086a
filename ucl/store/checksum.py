"""Checksums of stored bytes (docs/format.md): the xxh3-64 form, a dataset's whole checksum, the
flat chunk rule and chunk digests, and the digests that bind a rank file's chunk and tile tables to
the manifest. The tile grid and its hashing are in ``store.tiles``; a dataset's checksums computed
in one pass (whole, chunks, tiles) in ``store.digests``."""
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


def chunk_digests(raw: np.ndarray, size: int) -> np.ndarray:
    """xxh3-64 of each ``size``-byte piece of the flat uint8 array ``raw`` (the last may be
    shorter), as uint64; one call per piece, the pieces the rows of one 2-D view (a view per row
    costs less than a memoryview slice per piece)."""
    n = raw.size
    whole = n // size
    out = np.fromiter(map(xxhash.xxh3_64_intdigest, raw[:whole * size].reshape(whole, size)), np.uint64, whole)
    return out if whole * size == n else np.append(out, np.uint64(xxhash.xxh3_64_intdigest(raw[whole * size:])))


# Datasets above MIN_CHUNK_BYTES also carry a checksum per chunk of their flat bytes (in their rank
# file, as attributes), so a partial read (one rank's hyperslab) is verified by reading only the
# chunks it touches. Chunks are a power of two of at least MIN_CHUNK_BYTES, at most MAX_CHUNKS per
# dataset: a partial read rounds out by at most 1/1024 of the dataset at each end.
MIN_CHUNK_BYTES = 16 << 10
MAX_CHUNKS = 1024


HASH_BLOCK_BYTES = 1 << 20  # bytes hashed per step: each block is read from memory once, then from cache


def chunk_size(nbytes: int) -> int | None:
    """Chunk size in bytes for a dataset of ``nbytes``; None when it is small enough to verify whole."""
    if nbytes <= MIN_CHUNK_BYTES:
        return None
    size = MIN_CHUNK_BYTES
    while size * MAX_CHUNKS < nbytes:
        size *= 2
    return size


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


def tile_table_digest(whole: str, tile_shape: tuple[int, int], digests: np.ndarray) -> str:
    """``xxh3_64:<hex>`` binding a dataset's whole checksum to its tile table (tile rows and tile
    columns as little-endian int64, then each digest, little-endian, grid row-major)."""
    h = xxhash.xxh3_64(whole.encode("ascii"))
    h.update(np.asarray(tile_shape, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(digests, dtype="<u8").tobytes())
    return format_checksum(h.hexdigest())
