"""Writing a sharded HDF5 checkpoint: a temporary directory, datasets written whole or piecewise,
checksums, then one atomic commit. Several processes may write ranks into one temporary directory."""
from __future__ import annotations

import contextlib
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from .. import dtypes as _dt
from ..errors import StoreError
from . import h5, piecewise
from .atomic import TempDir, final_name_of, fsync_path, is_tmp_name, publish_dir, write_atomic
from .behind import WriteBehind
from .checksum import raw_bytes
from .digests import Digests, IncrementalChecksum, checksums
from .codec import Encoded, check_codec, encode, frame_table_digest
from .direct import MIN_DIRECT_BYTES
from .ledger import Filled, Ledger, entry_fields, known_digests
from .template import RankTemplate, allocate
from .manifest import COMPRESSED_VERSION, FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, TABLES_NAME, Manifest, check_entry, file_name


class CheckpointWriter:
    """Writes a checkpoint into a hidden temp directory; ``commit()`` publishes it atomically.

    ``fields`` are Manifest fields (spec, spec_name, dims, mesh, params, frozen, state) and
    may also be changed on ``writer.manifest`` before commit. In a ``with`` block an
    exception aborts; leaving it without ``commit()`` aborts and raises. An I/O error
    (e.g. ENOSPC) aborts at once and raises UCL410: nothing half-written becomes visible.

    ``compress`` (``"zstd"``, ``"lz4"``; None or ``"none"``: plain) stores what ``write`` writes in
    the compressed encoding (docs/format.md), coded in ``compress_threads`` threads; the other
    ways of writing (streams, laid-out files, templates, ``create``) always write plain datasets.
    """

    def __init__(self, path: str | os.PathLike[str], nranks: int, *, max_open_files: int = 64,
                 durable: bool = True, direct: bool | None = None, write_behind: bool = False,
                 publish: Callable[[str, str], None] | None = None, compress: str | None = None,
                 compress_threads: int = 1, **fields: Any):
        check_codec(compress)  # before anything is made
        self.path: str | None = os.path.abspath(os.fspath(path))
        # publish(tmp, path) replaces the rename of commit(): CheckpointRoot.publish replaces a step
        self._publish = publish or publish_dir
        if publish is None and os.path.lexists(self.path):  # checked before anything is written
            raise StoreError(f"cannot write checkpoint: {self.path} already exists", code="UCL405")
        if not isinstance(nranks, int) or nranks < 1:
            raise StoreError(f"nranks must be a positive integer, got {nranks!r}", code="UCL411")
        try:
            self.manifest = Manifest(files=[file_name(r) for r in range(nranks)],
                                     datasets=[{} for _ in range(nranks)], **fields)
        except TypeError as e:
            raise StoreError(f"unknown manifest field: {e}", code="UCL403") from None
        self.manifest.to_json()  # fail early on a bad mesh or non-JSON state
        try:  # locked while this writer lives; dead writers' leftovers of this name go first
            self._tmp: TempDir | None = TempDir(self.path)
        except OSError as e:
            raise StoreError(f"cannot create a temp directory beside {self.path}: {e}", code="UCL410") from e
        self.tmp_path = self._tmp.path
        self._setup(nranks, True, max_open_files, durable, direct, write_behind)
        self._compressing(compress, compress_threads)

    @classmethod
    def join(cls, tmp_path: str | os.PathLike[str], nranks: int, *, max_open_files: int = 64,
             durable: bool = True, direct: bool | None = None, write_behind: bool = False,
             compress: str | None = None, compress_threads: int = 1,
             behind_thread: bool = True) -> "CheckpointWriter":
        """A participant (another process) writing some ranks' files into an owner's ``tmp_path``.
        It calls ``finish()`` and hands the result to the owner's ``adopt()``; it cannot commit.
        ``behind_thread=False``: what ``write_behind`` writes itself is written before each call
        returns, not in a thread (the same files; on one core the thread only adds switches)."""
        self = cls.__new__(cls)
        self.path, self.manifest, self._tmp, self._publish = None, None, None, publish_dir  # type: ignore[assignment]
        self.tmp_path = os.path.abspath(os.fspath(tmp_path))
        if not os.path.isdir(self.tmp_path):
            raise StoreError(f"temp directory {self.tmp_path} does not exist", code="UCL404")
        self._setup(nranks, False, max_open_files, durable, direct, write_behind, behind_thread)
        self._compressing(compress, compress_threads)
        return self

    def _compressing(self, compress: str | None, threads: int) -> None:
        self.compress = check_codec(compress)
        self._coders = ThreadPoolExecutor(threads, "ucl-compress") if self.compress and threads > 1 else None

    def _setup(self, nranks: int, owner: bool, max_open: int, durable: bool, direct: bool | None,
               write_behind: bool, behind_thread: bool = True) -> None:
        # durable=False skips fsync of the rank files: the commit stays atomic against killed
        # processes, but not against a power loss before the OS writes the pages back.
        # direct (default: durable): large datasets bypass the page cache (store.direct); a durable write
        # pays for the disk anyway, and skips filling cache pages first.
        self.nranks, self._owner, self._state, self.durable = nranks, owner, "open", durable
        # write_behind: a large dataset's bytes are still being written when write() returns (while the
        # caller hashes, reads and assembles the next one), directly or through the page cache; the
        # caller leaves that array untouched until its next write() (or finish/commit) returns. One
        # dataset at most is in flight.
        self.direct = durable if direct is None else bool(direct)
        self.write_behind = bool(write_behind)
        self._out = WriteBehind(self.direct, self.write_behind and behind_thread)
        self._lock = threading.RLock()
        self._ledger = Ledger(nranks)  # entries, digest tables, laid-out datasets, files made or adopted
        self._piecewise = piecewise.Piecewise()  # datasets made by create(), written by write_flat/write_box
        self.filled: list[Filled] = []  # datasets this writer filled in files other writers laid out
        self._handles = h5.Handles(self._open_rank, max_open)

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            self.abort()
            raise StoreError("CheckpointWriter left its with-block without commit()/finish(); "
                             "checkpoint discarded", code="UCL411")

    def _open_rank(self, rank: int) -> Any:
        p = os.path.join(self.tmp_path, file_name(rank))
        if rank in self._ledger.created:
            return h5.open_h5(p, "r+")
        f = h5.open_h5(p, "w-")
        self._ledger.created.add(rank)
        f.attrs["ucl_format"], f.attrs["ucl_version"], f.attrs["ucl_rank"] = FORMAT_NAME, FORMAT_VERSION, rank
        return f

    @contextlib.contextmanager
    def _io(self) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            self.abort()
            raise StoreError(f"writing checkpoint {self.path or self._published_path()} failed: {e}; aborted, "
                             "nothing was published", code="UCL410") from e

    def _published_path(self) -> str:
        """Where a participant's files would be published (its owner's path, from the temp name)."""
        folder, name = os.path.split(self.tmp_path)
        return os.path.join(folder, final_name_of(name)) if is_tmp_name(name) else self.tmp_path

    def _check_open(self) -> None:
        if self._state != "open":
            raise StoreError(f"checkpoint writer is already {self._state}", code="UCL411")

    def _new_key(self, rank: int, key: str) -> tuple[str, str]:
        self._check_open()
        kind, name = self._ledger.claim(rank, key)
        if rank not in self._ledger.created and os.path.exists(os.path.join(self.tmp_path, file_name(rank))):
            raise StoreError(f"rank {rank}'s file was written by another writer", code="UCL411")
        return kind, name

    def write(self, rank: int, key: str, data: Any, *, dtype: str | None = None,
              digests: Digests | None = None, tiles: bool = True, coded: Encoded | None = None) -> None:
        """Write a whole dataset from an array or tensor; ``dtype`` declares raw-bit numpy input.
        ``digests``: its checksums, known already, so it is not hashed again: computed as it was filled
        (``store.digests.copy_checksummed``; the caller vouches that it has not changed since), or
        carried over from a verified source (``known_digests``). ``tiles=False``: a plain dataset hashed
        here gets no tile table (a writer may leave it out, docs/format.md). ``coded``: ``codec.encode``
        of these storage bytes with this writer's codec, done already (``store.ahead``), so not done here."""
        with self._lock:
            kind, name = self._new_key(rank, key)
            arr, logical = _dt.to_numpy(data, dtype)
            if coded is not None and not self.compress:
                raise StoreError(f"dataset {key!r} was handed over coded to a writer that does not compress",
                                 code="UCL411")
            enc = coded if coded is not None else (
                encode(arr, logical, self.compress, self._coders) if self.compress and arr.nbytes else None)
            if enc is not None and enc.stored.size < arr.nbytes:  # else plain: coding did not shrink it
                return self._write_packed(rank, key, kind, name, arr, logical, enc, digests)
            with self._io():
                self._out.settle()  # whatever path this dataset takes, the caller may reuse the last one's array
                f, opened = self._handles.get(rank)
                group = h5.group_of(f, opened, kind)
                if (self.direct or self.write_behind) and arr.nbytes >= MIN_DIRECT_BYTES:  # written by us
                    d, offset = h5.create_allocated(group, name, arr.shape, arr.dtype)
                    self._out.put(os.path.join(self.tmp_path, file_name(rank)), offset, raw_bytes(arr))
                else:
                    d = h5.create_dataset(group, name, arr.shape, arr.dtype, arr)
                    offset = h5.data_offset(d)
                h5.set_text_attrs(d, ucl_dtype=logical)
                digests = checksums(arr, tiles=tiles) if digests is None else \
                    known_digests(digests, arr.shape, arr.dtype, key)
                h5.set_checksum_tables(d, digests)
            self._ledger.record(rank, key, logical, arr.shape, digests, offset)

    def _write_packed(self, rank: int, key: str, kind: str, name: str, arr: np.ndarray, logical: str,
                      enc: Any, digests: Digests | None) -> None:
        """``write`` in the compressed encoding: the units coded (``enc``, codec.encode) into a uint8
        dataset of the stored bytes, with its frame table, and the checksums of the logical bytes."""
        digests = checksums(arr) if digests is None else known_digests(digests, arr.shape, arr.dtype, key)
        with self._io():
            self._out.settle()
            f, opened = self._handles.get(rank)
            n = enc.stored.size
            # always written by us (a fresh buffer: nobody reuses it): h5py's create_dataset with data
            # cost more than coding a small dataset
            d, offset = h5.create_allocated(h5.group_of(f, opened, kind), name, (n,), np.dtype(np.uint8))
            self._out.put(os.path.join(self.tmp_path, file_name(rank)), offset, enc.stored)
            # the digest tables are in ucl_tables only (their attributes would tell HDF5 tools nothing:
            # these bytes are coded), as the training checkpointer's plain datasets have them
            h5.set_text_attrs(d, ucl_dtype=logical, ucl_encoding=self.compress)
        e = self._ledger.record(rank, key, logical, arr.shape, digests, offset, enc.table())
        e.update(encoding=self.compress, stored=n, group=enc.group,
                 frames=frame_table_digest(digests.whole, self.compress, n, enc.ends, enc.digests, enc.group))

    def write_stream(self, targets: Mapping[int, int | None], key: str, shape: Sequence[int], dtype: str,
                     pieces: Iterable[np.ndarray], *, digests: Digests | None = None, tiles: bool = True) -> None:
        """Write one dataset (logical ``dtype``) into the file of every rank in ``targets`` from
        ``pieces``: 1-D storage arrays that follow each other in flat order and cover it exactly.
        ``targets`` maps a rank to the byte offset of the dataset in a file another writer laid out
        (``lay_out``; the report joins ``self.filled``), or to None: created here. Each piece is
        hashed while it is in cache and then written, so a dataset of any size passes through a
        few blocks of memory. With ``write_behind`` up to ``STREAM_DEPTH`` pieces are still being
        written when the next is drawn, and when this returns (the next call of any other method
        waits for them): a piece's memory may be reused ``STREAM_DEPTH + 1`` pieces later, counted
        across calls, not sooner. ``digests``: the dataset's checksums, known already (``known_digests``),
        so the pieces are not hashed again; ``tiles`` as for ``write``."""
        with self._lock:
            shape = tuple(int(x) for x in shape)
            sdtype = _dt.storage_dtype(dtype)
            total = math.prod(shape)
            at: dict[int, tuple[str, int]] = {}
            made = {}
            with self._io():
                self._out.settle(pieces=False)  # the pieces of earlier streams may still be in flight
                for rank, offset in sorted(targets.items()):
                    path = os.path.join(self.tmp_path, file_name(rank))
                    if offset is None:
                        kind, name = self._new_key(rank, key)
                        f, opened = self._handles.get(rank)
                        d, offset = h5.create_allocated(h5.group_of(f, opened, kind), name, shape, sdtype)
                        h5.set_text_attrs(d, ucl_dtype=dtype)
                        made[rank] = (d, offset)
                    else:
                        self._check_open()
                    at[rank] = (path, offset)
                known = None if digests is None else known_digests(digests, shape, sdtype, key)
                h, pos = None if known is not None else IncrementalChecksum(shape, sdtype, tiles=tiles), 0
                for piece in pieces:
                    if piece.dtype != sdtype or piece.ndim != 1 or pos + piece.size > total:
                        raise StoreError(f"write_stream of {key!r}: a piece of {piece.dtype} {list(piece.shape)} "
                                         f"at element {pos} of {total} ({sdtype})", code="UCL409")
                    if h is not None:
                        h.advance(pos, piece)
                    raw = raw_bytes(piece)
                    spots = [(p, o + pos * sdtype.itemsize) for p, o in at.values()]
                    self._out.put_piece(spots, raw)
                    pos += piece.size
                digests = (known if pos == total else None) if h is None else h.result(total)
                if digests is None:
                    raise StoreError(f"write_stream of {key!r}: pieces cover {pos} of its {total} elements",
                                     code="UCL409")
                for rank, (d, offset) in made.items():
                    h5.set_checksum_tables(d, digests)
                    self._ledger.record(rank, key, dtype, shape, digests, offset)
            for rank in targets:
                if rank not in made:
                    self.filled.append(Filled(int(rank), key, dtype, shape, digests))

    def lay_out(self, rank: int, datasets: Mapping[str, tuple[Sequence[int], str]]) -> dict[str, int | None]:
        """Create rank ``rank``'s file with every dataset of ``datasets`` (key -> (shape, dtype))
        allocated, and close it: several processes then write the data at the returned byte offsets
        (``fill``; None for an empty dataset) at once, and ``adopt_filled`` their reports here. Why:
        one large file (a universal checkpoint) is written by many processes, not one."""
        with self._lock:
            for key in datasets:
                self._new_key(rank, key)
            specs = {key: (tuple(int(x) for x in shape), dtype) for key, (shape, dtype) in sorted(datasets.items())}
            with self._io():
                offsets = self._ledger.lay(rank, specs, lambda: allocate(self._handles.get(rank)[0], specs))
                self._handles.release(rank)  # others write into it from now on
            return offsets

    def fill(self, rank: int, key: str, offset: int | None, data: Any, *, dtype: str | None = None,
             digests: Digests | None = None, tiles: bool = True) -> None:
        """Write a whole dataset's bytes at ``offset`` of a file another writer laid out (``lay_out``),
        and hash them (unless their ``digests`` are known, as for ``write``; ``tiles`` as there); the
        report joins ``self.filled`` for that writer's ``adopt_filled``."""
        with self._lock:
            self._check_open()
            arr, logical = _dt.to_numpy(data, dtype)
            with self._io():
                self._out.settle()
                if offset is not None and arr.nbytes:
                    self._out.put(os.path.join(self.tmp_path, file_name(rank)), offset, raw_bytes(arr))
                digests = checksums(arr, tiles=tiles) if digests is None else \
                    known_digests(digests, arr.shape, arr.dtype, key)
            self.filled.append(Filled(int(rank), key, logical, tuple(arr.shape), digests))

    def adopt_filled(self, filled: Iterable[Filled]) -> None:
        """Finish the datasets other processes filled in files this writer laid out: their checksums
        (attributes, digest tables, manifest entries). Each must match its layout, once."""
        with self._lock:
            self._check_open()
            with self._io():
                for p in filled:
                    shape, dtype, offset = self._ledger.take_filled(p)
                    f, _ = self._handles.get(p.rank)
                    h5.set_checksum_tables(f[p.key], p.digests)
                    self._ledger.record(p.rank, p.key, dtype, shape, p.digests, offset)

    def template(self, rank: int, datasets: Mapping[str, tuple[Sequence[int], str]], *,
                 tiles: bool = True) -> RankTemplate:
        """Lay out a rank file for ``datasets`` (key -> (shape, dtype)) once, for ``write_from`` to
        replay at every checkpoint of the same layout (store.template); ``tiles=False``: without
        tile checksums (readers then verify column slices by flat chunks)."""
        with self._lock:
            self._check_open()
            with self._io():
                return RankTemplate.build(os.path.join(self.tmp_path, f".template-{rank}-{os.getpid()}.h5"), rank,
                                          datasets, tiles=tiles)

    def write_from(self, rank: int, template: RankTemplate, arrays: Mapping[str, Any],
                   digests: Mapping[str, Digests] | None = None) -> None:
        """Write rank ``rank``'s whole file at once: ``template``'s structure and ``arrays`` (key ->
        storage array, exactly the template's datasets), with no HDF5 call. Readers see what
        ``write`` of each array gives, less the checksum attributes (the digests are in ``ucl_tables``).
        ``digests``: the checksums of some arrays, computed as they were filled
        (``store.digests.copy_checksummed``); the caller vouches that the arrays have not changed since."""
        with self._lock:
            for key in template.datasets:
                self._new_key(rank, key)
            template.check(arrays)
            path = os.path.join(self.tmp_path, file_name(rank))

            def write_large(p: str, offset: int, raw: np.ndarray) -> None:
                self._out.settle()  # one dataset in flight, as in write()
                self._out.put(p, offset, raw)
            with self._io():
                self._out.settle()
                placed = template.write(path, arrays, write_large, digests)
                self._out.settle()
            self._ledger.created.add(rank)
            for key, t in template.datasets.items():
                p = placed[key]
                self._ledger.entries[rank][key] = entry_fields(t.dtype, t.shape, p.digests, t.offset, p.tables)

    def write_pieces(self, rank: int, template: RankTemplate, pieces: Iterable[tuple[str, int, np.ndarray]],
                     digests: Callable[[], Mapping[str, Digests]]) -> None:
        """Write rank ``rank``'s file from ``template`` piece by piece: each (key, byte offset in
        the dataset, flat uint8 bytes) is on its way to disk (or staged) before the next is taken,
        so the caller may reuse a piece's memory then (a snapshot streamed through a ring of host
        memory). ``digests()``, called after the last piece, gives every dataset's checksums,
        computed as the pieces were filled; the bytes each dataset got must add up to its size."""
        with self._lock:
            self._check_open()
            for key in template.datasets:
                self._new_key(rank, key)
            path = os.path.join(self.tmp_path, file_name(rank))

            def write_large(p: str, offset: int, raw: np.ndarray) -> None:
                self._out.now(p, offset, raw)  # here: the piece is released after
            with self._io():
                self._out.settle()
                placed = template.stream(path, pieces, digests, write_large)
            self._ledger.created.add(rank)
            for key, t in template.datasets.items():
                p = placed[key]
                self._ledger.entries[rank][key] = entry_fields(t.dtype, t.shape, p.digests, t.offset, p.tables)

    @property
    def write_cpu_seconds(self) -> float:
        """CPU time spent writing large datasets' bytes so far, in whichever thread wrote them
        (write-behind included; read it after ``commit``, when no write is in flight)."""
        return self._out.disk.cpu_seconds

    def _stop_behind(self) -> None:
        self._out.close()
        if getattr(self, "_coders", None) is not None:
            self._coders.shutdown(wait=True)
            self._coders = None

    def create(self, rank: int, key: str, shape: Sequence[int], dtype: str) -> None:
        """Preallocate a dataset to fill with ``write_flat``/``write_box``; unwritten elements read as 0."""
        with self._lock:
            self._new_key(rank, key)
            shape = tuple(int(x) for x in shape)
            if any(x < 0 for x in shape):
                raise StoreError(f"negative shape {list(shape)} for {key!r}", code="UCL409")
            with self._io():
                f, cache = self._handles.get(rank)
                cache[key] = self._piecewise.create(f, rank, key, shape, dtype)
            self._ledger.entries[rank][key] = {"dtype": dtype, "shape": list(shape), "checksum": None}

    def _prealloc(self, rank: int, key: str, data: Any) -> tuple[Any, tuple[int, ...], IncrementalChecksum, np.ndarray]:
        """A preallocated dataset ``data`` goes into (once the write in flight is done): its HDF5
        dataset, shape, running checksums, and ``data`` as storage."""
        self._check_open()
        p = self._piecewise.checksum(rank, key)
        e = self._ledger.entries[rank][key]
        arr = piecewise.storage(data, e["dtype"], f"rank {rank} dataset {key!r}")
        with self._io():
            self._out.settle()
            f, cache = self._handles.get(rank)
            d = cache.get(key)
            if d is None:
                d = cache[key] = f[key]
        return d, tuple(e["shape"]), p, arr

    def write_flat(self, rank: int, key: str, start: int, data: Any) -> None:
        """Write ``data`` (flattened) at row-major flat offset ``start`` of a preallocated dataset."""
        with self._lock:
            d, shape, p, arr = self._prealloc(rank, key, data)
            with self._io():
                piecewise.write_flat(d, shape, p, int(start), arr, f"rank {rank} dataset {key!r}")

    def write_box(self, rank: int, key: str, starts: Sequence[int], data: Any) -> None:
        """Write ``data`` into the box at ``starts`` (sizes = ``data.shape``) of a preallocated dataset."""
        with self._lock:
            d, shape, p, arr = self._prealloc(rank, key, data)
            with self._io():
                piecewise.write_box(d, shape, p, tuple(int(s) for s in starts), arr, f"rank {rank} dataset {key!r}")

    def write_slice(self, rank: int, key: str, where: Any, data: Any) -> None:
        """``where`` is a flat offset (int), box starts (ints) or a tuple of unit-step slices."""
        if isinstance(where, (int, np.integer)):
            return self.write_flat(rank, key, int(where), data)
        where = tuple(where) if isinstance(where, (tuple, list)) else (where,)
        if all(isinstance(w, slice) for w in where):
            if any(w.step not in (None, 1) for w in where):
                raise StoreError("write_slice needs unit-step slices", code="UCL409")
            where = tuple(w.start or 0 for w in where)
        return self.write_box(rank, key, where, data)

    def _flush(self, ranks: Sequence[int]) -> None:
        """Finish checksums, close files, create empty files for ``ranks`` lacking one, fsync them."""
        with self._io():
            self._out.settle()
            self._stop_behind()
            for (rank, key), p in self._piecewise.pending():
                e = self._ledger.entries[rank][key]  # create()'s entry, checksums to come
                dtype, shape = e["dtype"], tuple(e["shape"])
                d = self._handles.get(rank)[0][key]
                digests = p.result(math.prod(shape)) or h5.checksum_dataset(d, shape, _dt.storage_dtype(dtype))
                self._ledger.record(rank, key, dtype, shape, digests, h5.data_offset(d))
                h5.set_checksum_tables(d, digests)
            self._piecewise.clear()
            unfilled = self._ledger.unfilled()
            if unfilled:
                raise StoreError(f"datasets laid out but never filled: {unfilled}", code="UCL411")
            for rank in ranks:
                if rank not in self._ledger.created:
                    self._handles.get(rank)
            for rank in sorted(self._ledger.created):  # each file's digest tables, in its ucl_tables
                values = self._ledger.queued_tables(rank)
                if values is not None:
                    self._ledger.place_tables(rank, h5.create_table(self._handles.get(rank)[0], TABLES_NAME, values))
            self._handles.close(strict=True)  # HDF5 writes metadata here: a full disk must fail the commit
            for rank in ranks if self.durable else ():
                fsync_path(os.path.join(self.tmp_path, file_name(rank)))

    def finish(self, ranks: Sequence[int] | None = None) -> dict[int, dict[str, dict[str, Any]]]:
        """Participant side: make files durable and return ``{rank: entries}`` for the owner's ``adopt``.
        ``ranks`` (default: those written) get a file even if empty."""
        with self._lock:
            self._check_open()
            ranks = sorted(self._ledger.created | set(ranks or ()))
            self._flush(ranks)
            self._state = "finished"
            return {r: self._ledger.entries[r] for r in ranks}

    def adopt(self, rank: int, entries: dict[str, dict[str, Any]]) -> None:
        """Owner side: take over rank ``rank``, whose file another process wrote into ``tmp_path``."""
        with self._lock:
            self._check_open()
            if not self._owner or not 0 <= rank < self.nranks or rank in self._ledger.created:
                raise StoreError(f"cannot adopt rank {rank}", code="UCL411")
            if not os.path.isfile(os.path.join(self.tmp_path, file_name(rank))):
                raise StoreError(f"cannot adopt rank {rank}: {file_name(rank)} not in {self.tmp_path}", code="UCL411")
            for key, e in entries.items():
                check_entry(rank, key, e)
            self._ledger.entries[rank] = {k: dict(e) for k, e in entries.items()}
            self._ledger.adopted.add(rank)

    def commit(self) -> str:
        """Flush, fsync, write manifest.json, then rename the temp dir to ``path``. Returns ``path``.
        Either the checkpoint is published whole or the writer is aborted."""
        with self._lock:
            self._check_open()
            if not self._owner:
                raise StoreError("a joined writer cannot commit; call finish()", code="UCL411")
            try:
                self._flush([r for r in range(self.nranks) if r not in self._ledger.adopted])
                self.manifest.datasets, self.manifest.created = self._ledger.entries, None
                if any("encoding" in e for entries in self._ledger.entries for e in entries.values()):
                    self.manifest.version = COMPRESSED_VERSION  # older readers refuse it (UCL402)
                text = self.manifest.to_json().encode()
                with self._io():
                    write_atomic(os.path.join(self.tmp_path, MANIFEST_NAME), text)
                    self._publish(self.tmp_path, self.path)
            except BaseException:
                self.abort()
                raise
            self._state = "committed"
            self._tmp.release()
            return self.path

    def abort(self) -> None:
        """Discard everything written; idempotent, no-op after commit() or finish()."""
        with self._lock:
            if self._state in ("committed", "aborted", "finished"):  # finished files belong to the owner
                return
            self._state = "aborted"
            with contextlib.suppress(BaseException):  # nothing may still be writing into what is discarded
                self._out.settle()
            self._stop_behind()
            self._handles.discard()
            if self._owner:
                self._tmp.discard()
            else:
                for rank in self._ledger.created:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.tmp_path, file_name(rank)))
