"""Compression benchmark (issue #32): the compressed encoding (docs/format.md, "Compressed datasets")
on the state of a model really trained here, side by side in one run with zstd and lz4 on the raw
bytes (same units, no byte-plane transform) and with torch.save of the same state.

    python bench/compress.py [--steps 300] [--dim 256] [--layers 4] [--rounds 3] [--rate-mb 1000 250]
                             [--cache FILE] [--large-shape 8192 4096] [--shard 6 4096 2048]
                             [--only codecs large durable fixtures slices]

The model: a toy next-token MLP language model (embedding, --layers residual MLP blocks with
LayerNorm, output head; torch.nn, CPU), trained --steps AdamW steps on sequences of a fixed random
Markov chain, so the weights and moments are those of real training, not of initialisation. Two
variants of its state: fp32 (weights, exp_avg, exp_avg_sq) and bf16 mixed precision (bf16 weights =
the fp32 master cast, fp32 master, moments).

Reported, medians (min-max) over --rounds: per kind and codec, stored / logical bytes and the
saving; compress and decompress throughput of one thread (logical bytes per second of the thread's
own CPU time: per core, and not inflated by other processes waiting for the same cores);
time to durable of a Checkpointer save (save -> wait()) with and without compression when the disk
is the bottleneck, under two models of a disk of --rate-mb MB/s: "fsync-paced", each rank file's
fsync first sleeps (file bytes / rate), so nothing overlaps the device; and "write-paced", each
write of a dataset's bytes sleeps (its bytes / rate) in the thread that writes them, as a
write-through device (ucl writes large datasets with O_DIRECT) would block it, and the fsync
sleeps for the file's bytes not yet paced (small datasets, tables, metadata): the device is busy
while the next dataset is coded, as a real one is (bytes never written, the unused room of a
compressed dataset, are not paced: a file's bytes are those allocated on disk). Two states: the toy
model's (fp32 weights and AdamW moments, ~38 MB in 108 datasets, both disk models), and a shard of
a large model's size (write-paced only): --shard N ROWS COLS, N weight matrices of ROWS x COLS whose
values are the trained weights repeated (np.resize of them all, flattened, as the 'large' part
does), with AdamW state whose exp_avg and exp_avg_sq are the trained moments repeated the same
way, in two variants: "fp32" (fp32 weights and moments: 3N datasets, 576 MiB at the default
6 x 4096 x 2048) and "bf16 mixed" (bf16 weights, the fp32 master they are cast from, the moments:
4N datasets, 672 MiB);
the same per core on a matrix of a large shard's size (--large-shape) filled with the trained
weights' or exp_avg_sq's values repeated (their statistics, with the units of a large shard);
compression ratios of the held-in test fixtures (tests/fixtures: DeepSpeed, Megatron, DCP
checkpoints of tiny models, imported, then resharded compressed); a column slice and a row slice
read (a quarter of the columns or rows of a matrix saved whole: what load_rank does for another
tensor-parallel degree), verified: bytes read from disk, against the stored bytes of the units
holding them, and time. The raw codecs (no transform) are zstd level 1 and lz4's default, on the
same units. It runs against older ucl checkouts too (units of one chunk or tile, no ``group``),
so before and after are measured in one session. Not a timed test: figures for the issue's note.
"""
from __future__ import annotations

import argparse, io, json, os, statistics, sys, tempfile, time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ucl  # noqa: E402
import ucl.store.direct as store_direct  # noqa: E402
import ucl.store.writer as store_writer  # noqa: E402
from ucl.store import Checkpoint, CheckpointWriter  # noqa: E402
from ucl.store.codec import decode_unit, encode, unit_view, units_of  # noqa: E402


def units_for(shape, itemsize, enc):
    """The units of an encoded dataset (older ucl: one per chunk or tile, no group)."""
    return units_of(shape, itemsize, enc.group) if hasattr(enc, "group") else units_of(shape, itemsize)


def raw_coders(codec: str):
    """zstd level 1 or lz4's default on raw bytes: (compress, decompress(data, size))."""
    if codec == "zstd":
        import zstandard
        c, d = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
        return c.compress, lambda data, n: d.decompress(data, max_output_size=n)
    import lz4.block
    return (lambda data: lz4.block.compress(data, store_size=False),
            lambda data, n: lz4.block.decompress(data, uncompressed_size=n))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                                  nn.Linear(4 * dim, dim)) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def train(args) -> tuple[Model, torch.optim.Optimizer, float, float]:
    torch.manual_seed(0)
    vocab = 2048
    chain = torch.randint(0, vocab, (vocab, 4))  # each token is followed by one of 4
    model = Model(vocab, args.dim, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    first = last = 0.0
    for step in range(args.steps):
        x = torch.randint(0, vocab, (32,))
        seq = [x]
        for _ in range(16):
            seq.append(chain[seq[-1], torch.randint(0, 4, (32,))])
        seq = torch.stack(seq, 1)
        loss = nn.functional.cross_entropy(model(seq[:, :-1]).reshape(-1, vocab), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if step == 0 else first
        last = loss.item()
    return model, opt, first, last


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def kinds(model: Model, opt) -> dict[str, list[tuple[np.ndarray, str]]]:
    """Per kind, the tensors (storage arrays, logical dtype) of both variants."""
    params = [p for p in model.parameters()]
    st = [opt.state[p] for p in params]
    fp32 = [(p.detach().numpy(), "float32") for p in params]
    return {
        "fp32 weights": fp32,
        "bf16 weights": [(bf16_bits(p), "bfloat16") for p in params],
        "fp32 master": fp32,
        "exp_avg": [(s["exp_avg"].numpy(), "float32") for s in st],
        "exp_avg_sq": [(s["exp_avg_sq"].numpy(), "float32") for s in st],
    }


def med(xs) -> str:
    return f"{statistics.median(xs):.3g} ({min(xs):.3g}-{max(xs):.3g})"


def codec_figures(tensors, codec: str, rounds: int, raw: bool = True) -> dict:
    """ucl's encoding and the raw codec on the same units: sizes, one-thread throughput."""
    logical = sum(a.nbytes for a, _ in tensors)
    comp, decomp, stored = [], [], 0
    for _ in range(rounds):
        t0 = time.thread_time()
        encs = [encode(np.ascontiguousarray(a), d, codec) for a, d in tensors]
        comp.append(logical / (time.thread_time() - t0) / 1e9)
        stored = sum(e.stored.size for e in encs)
        t0 = time.thread_time()
        for (a, d), e in zip(tensors, encs):
            units, view = units_for(a.shape, a.itemsize, e), memoryview(e.stored)
            for u in range(units.count):
                lo = int(e.ends[u - 1]) if u else 0
                out = np.empty(units.unit_bytes(u), np.uint8)
                decode_unit(view[lo:int(e.ends[u])], out.size, d, a.itemsize, codec, out, str)
        decomp.append(logical / (time.thread_time() - t0) / 1e9)
    figures = {"logical": logical, "stored": stored, "saving": 1 - stored / logical,
               "compress_GBps": comp, "decompress_GBps": decomp}
    if not raw:
        return figures
    compress, decompress = raw_coders(codec)
    rcomp, rdecomp, rstored = [], [], 0
    for _ in range(rounds):
        pieces, t0 = [], time.thread_time()
        for (a, _), e in zip(tensors, encs):
            units = units_for(a.shape, a.itemsize, e)
            pieces += [(compress(unit_view(np.ascontiguousarray(a), units, u).tobytes()), units.unit_bytes(u))
                       for u in range(units.count)]
        rcomp.append(logical / (time.thread_time() - t0) / 1e9)
        rstored = sum(len(p) for p, _ in pieces)
        t0 = time.thread_time()
        for p, n in pieces:
            decompress(p, n)
        rdecomp.append(logical / (time.thread_time() - t0) / 1e9)
    return {**figures, "raw_stored": rstored, "raw_saving": 1 - rstored / logical,
            "raw_compress_GBps": rcomp, "raw_decompress_GBps": rdecomp}


def on_disk(path) -> int:
    """Bytes of a file allocated on disk (its unwritten holes left out)."""
    st = Path(path).stat()
    return min(st.st_size, st.st_blocks * 512)


def durable_times(model, opt, args, work: Path, disks=("fsync-paced", "write-paced"), variants=None) -> dict:
    """save -> wait() of a Checkpointer, the disk paced at each rate under each model (module doc)."""
    real_fsync, real_write = store_writer.fsync_path, store_direct.DirectWriter.write
    out = {}
    for model_name in disks:
        for rate in args.rate_mb:
            paced: dict = {}  # file -> bytes already paced by its writes

            def write(self, path, offset, data, direct=True, _rate=rate):
                real_write(self, path, offset, data, direct)
                paced[str(path)] = paced.get(str(path), 0) + data.size
                time.sleep(data.size / (_rate * 1e6))

            def fsync(path, _rate=rate):
                size = on_disk(path) if Path(path).is_file() else 0
                time.sleep(max(0, size - paced.pop(str(path), 0)) / (_rate * 1e6))
                real_fsync(path)
            store_writer.fsync_path = fsync
            if model_name == "write-paced":
                store_direct.DirectWriter.write = write
            try:
                if variants is None:
                    variants = [(None, 1), ("zstd", 1), ("lz4", 1)]
                    variants += [("zstd", args.threads), ("lz4", args.threads)] if args.threads > 1 else []
                for codec, threads in variants:
                    times, cpus, size, load0 = [], [], 0, os.getloadavg()[0]
                    root = Path(tempfile.mkdtemp(dir=work))
                    with ucl.Checkpointer(str(root), model, opt, keep=2, compress=codec,
                                          compress_threads=threads) as ck:
                        for i in range(args.rounds + 1):
                            t0 = time.perf_counter()
                            ck.save(i + 1)
                            ck.wait()
                            if i:  # the first builds the layout: not counted
                                times.append(time.perf_counter() - t0)
                                cpus.append([e for e in ck.trace.events() if e["phase"] == "flush"][-1]["cpu"])
                        latest = ck.root.latest()
                        size = sum(on_disk(f) for f in Path(latest).glob("*.h5"))
                    out[f"{model_name} {rate:g} MB/s {codec or 'plain'}" + (f" x{threads}" if codec else "")] = {
                        "seconds": times, "file_bytes": size, "flush_cpu": cpus,
                        "load": [load0, os.getloadavg()[0]]}
            finally:
                store_writer.fsync_path, store_direct.DirectWriter.write = real_fsync, real_write
    return out


def slices(model, args, work: Path) -> dict:
    """A quarter of the columns, and a quarter of the rows, of the largest matrix, read verified:
    plain vs compressed; bytes read against the stored bytes of the units holding them."""
    w = max((p for p in model.parameters() if p.dim() == 2), key=lambda p: p.numel()).detach().numpy()
    rows, cols = w.shape
    q, h = cols // 4, rows // 4
    out = {"shape": [rows, cols]}
    for codec in (None, "zstd", "lz4"):
        path = work / f"slice-{codec}"
        with CheckpointWriter(path, 1, compress=codec) as wr:
            wr.write(0, "param/w", w)
            wr.commit()
        for what, runs in (("columns", [(q, rows, cols, q)]), ("rows", [(h * cols, h, cols, cols)])):
            times, got, need = [], 0, 0
            for _ in range(args.rounds):
                with Checkpoint.open(path) as c:  # a fresh reader: nothing cached
                    info = c.info(0, "param/w")
                    t0 = time.perf_counter()
                    c.read_runs(0, "param/w", runs, verify=True)
                    times.append(time.perf_counter() - t0)
                    got = c.stored_read.stored if codec else c.bytes_last_read
                    g = units_of(w.shape, w.itemsize).grid
                    if codec and g is not None:  # the stored bytes of the units holding those columns or rows
                        enc = encode(w, "float32", codec)
                        g = units_for(w.shape, w.itemsize, enc).grid
                        lens = np.diff(np.concatenate([[0], enc.ends.astype(np.int64)]))
                        if what == "columns":
                            bands, js = range(g.nr), range(q // g.tile_cols, (2 * q - 1) // g.tile_cols + 1)
                        else:
                            bands, js = range(h // g.tile_rows, (2 * h - 1) // g.tile_rows + 1), range(g.nc)
                        need = int(sum(lens[b * g.nc + j] for b in bands for j in js))
                    elif not codec:
                        need = rows * q * w.itemsize if what == "columns" else h * cols * w.itemsize
            out[f"{what} {codec or 'plain'}"] = {"seconds": times, "bytes_read": got, "bytes_needed": need,
                                                "file_bytes": info.file_bytes}
    return out


def fixtures(work: Path) -> dict:
    """Stored / logical bytes of each held-in fixture that imports, resharded compressed."""
    out = {}
    base = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
    for folder in sorted(p for p in base.glob("*/*") if p.is_dir()):
        name = f"{folder.parent.name}/{folder.name}"
        try:
            plain = work / f"fx-{len(out)}"
            ucl.import_checkpoint(folder, plain)
            mesh = [(a, s) for a, s in ucl.open(plain).manifest.mesh]
            mesh = ucl.Mesh(**dict(mesh)) if mesh else "universal"
        except Exception:  # not every fixture is a checkpoint ucl imports alone (plans, broken ones)
            continue
        row = {}
        for codec in ("zstd", "lz4"):
            ucl.reshard(plain, work / f"fx-{len(out)}-{codec}", mesh, compress=codec, workers=1)
            m = ucl.open(work / f"fx-{len(out)}-{codec}").manifest
            entries = [e for ds in m.datasets for e in ds.values()]
            logical = sum(ucl.store.DatasetInfo(e["dtype"], tuple(e["shape"]), e["checksum"]).nbytes for e in entries)
            row[codec] = {"logical": logical, "stored": sum(e.get("stored", 0) or
                                                            ucl.store.DatasetInfo(e["dtype"], tuple(e["shape"]),
                                                                                  e["checksum"]).nbytes
                                                            for e in entries)}
        out[name] = row
    return out


def model_args(ap: argparse.ArgumentParser) -> None:
    """The trained model's arguments (what ``trained`` reads), shared with bench/entropy.py."""
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cache", help="the trained model and optimizer state: loaded from this file when it exists "
                    "(written there after training otherwise), so runs against two checkouts share one training")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(ap)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate-mb", type=float, nargs="+", default=[1000.0, 250.0])
    ap.add_argument("--threads", type=int, default=2, help="the Checkpointer's compress_threads, beside 1")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--large-shape", type=int, nargs=2, default=[8192, 4096], metavar=("ROWS", "COLS"),
                    help="the matrix of the 'large' part (default 8192 4096: 128 MiB of fp32)")
    ap.add_argument("--shard", type=int, nargs=3, default=[6, 4096, 2048], metavar=("N", "ROWS", "COLS"),
                    help="the large state of the durable part: N weight matrices of ROWS x COLS and their moments")
    ap.add_argument("--only", choices=["codecs", "large", "durable", "fixtures", "slices"], nargs="+",
                    help="run these parts only (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model, opt, first, last, loaded = trained(args)
    how = f"loaded from {args.cache}" if loaded else f"trained {args.steps} steps in {time.perf_counter() - t0:.1f} s"
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {how}: loss {first:.3f} -> {last:.3f}")
    figures: dict = {"loss": [first, last]}
    parts = set(args.only or ["codecs", "large", "durable", "fixtures", "slices"])
    if "codecs" in parts:
        figures.update(codec_part(model, opt, args))
    if "large" in parts:
        figures["large"] = large_part(model, opt, args)
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        if "durable" in parts:
            figures["durable"] = durable_part(model, opt, args, work)
        if "fixtures" in parts:
            figures["fixtures"] = fixtures_part(work)
        if "slices" in parts:
            figures["slices"] = slices_part(model, args, work)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


def trained(args):
    """The trained model and optimizer (from ``--cache`` when it holds them), first and last loss,
    and whether they were loaded."""
    if args.cache and Path(args.cache).exists():
        saved = torch.load(args.cache, weights_only=True)
        model = Model(2048, args.dim, args.layers)
        model.load_state_dict(saved["model"])
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        opt.load_state_dict(saved["optimizer"])
        return model, opt, *saved["loss"], True
    model, opt, first, last = train(args)
    if args.cache:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "loss": [first, last]}, args.cache)
    return model, opt, first, last, False


def codec_part(model, opt, args) -> dict:
    figures, per_kind = {}, {}
    for kind, tensors in kinds(model, opt).items():
        for codec in ("zstd", "lz4"):
            f = codec_figures(tensors, codec, args.rounds)
            per_kind[f"{kind} {codec}"] = f
            print(f"{kind:13s} {codec:4s}: {f['logical'] / 1e6:6.2f} MB -> ucl {f['saving']:6.1%} smaller, "
                  f"compress {med(f['compress_GBps'])} GB/s, decompress {med(f['decompress_GBps'])} GB/s | raw "
                  f"{codec} {f['raw_saving']:6.1%} smaller, {med(f['raw_compress_GBps'])} / "
                  f"{med(f['raw_decompress_GBps'])} GB/s")
    figures["kinds"] = per_kind
    for variant, members in (("fp32 state", ("fp32 weights", "exp_avg", "exp_avg_sq")),
                             ("bf16 mixed state", ("bf16 weights", "fp32 master", "exp_avg", "exp_avg_sq"))):
        for codec in ("zstd", "lz4"):
            lg = sum(per_kind[f"{k} {codec}"]["logical"] for k in members)
            sd = sum(per_kind[f"{k} {codec}"]["stored"] for k in members)
            rw = sum(per_kind[f"{k} {codec}"]["raw_stored"] for k in members)
            print(f"{variant} {codec}: {lg / 1e6:.2f} MB -> ucl {1 - sd / lg:.1%} smaller, raw {codec} {1 - rw / lg:.1%}")
            figures[f"{variant} {codec}"] = {"logical": lg, "stored": sd, "raw_stored": rw}
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    figures["torch.save bytes"] = buf.tell()
    print(f"torch.save of the fp32 state (model + optimizer): {buf.tell() / 1e6:.2f} MB")
    return figures


def reader_figure(arr: np.ndarray, dtype: str, rounds: int) -> list[float]:
    """Decode speed as a load sees it: the dataset written compressed, then read whole by one
    reader (its caches at 32 MiB, a quarter of the matrix: a whole read in order gets no hits; the
    first read not counted: the file in the page cache), thread CPU:
    the unit decodes plus reading the stored bytes and placing the units."""
    with tempfile.TemporaryDirectory() as d:
        with CheckpointWriter(Path(d) / "c", 1, compress="zstd") as wr:
            wr.write(0, "param/w", arr, dtype=dtype)
            wr.commit()
        with Checkpoint.open(Path(d) / "c") as c:
            c.limit_caches(32 << 20)
            c.read(0, "param/w", verify=False)
            rates = []
            for _ in range(rounds):
                t0 = time.thread_time()
                c.read(0, "param/w", verify=False)
                rates.append(arr.nbytes / (time.thread_time() - t0) / 1e9)
    return rates


def large_part(model, opt, args) -> dict:
    """Per-core speed on shards of a real model's size: the trained weights and exp_avg_sq values
    repeated into one matrix of --large-shape (fp32, and its bf16 cast): the trained values'
    statistics with the unit sizes of a large shard, which the toy model's small tensors lack."""
    rows, cols = args.large_shape
    out = {}
    params = list(model.parameters())
    sources = {"weights": np.concatenate([p.detach().numpy().reshape(-1) for p in params]),
               "exp_avg_sq": np.concatenate([opt.state[p]["exp_avg_sq"].numpy().reshape(-1) for p in params])}
    for name, flat in sources.items():
        big = np.resize(flat, rows * cols).reshape(rows, cols)
        for dtype, arr in (("float32", big), ("bfloat16", bf16_bits(torch.from_numpy(big)))):
            arr = np.ascontiguousarray(arr)
            f = codec_figures([(arr, dtype)], "zstd", args.rounds, raw=False)
            f["read_GBps"] = reader_figure(arr, dtype, args.rounds)
            out[f"{name} {dtype}"] = f
            print(f"large {name} {dtype} {list(arr.shape)} zstd: {arr.nbytes / 1e6:.0f} MB -> {f['saving']:.1%} smaller, "
                  f"compress {med(f['compress_GBps'])} GB/s, decompress {med(f['decompress_GBps'])} GB/s, "
                  f"read whole by the reader {med(f['read_GBps'])} GB/s")
    return out


class Shard(nn.Module):
    """The large state's parameters (module doc): ``weights`` (fp32, the optimizer's), and in the
    mixed variant ``bf16`` (their bf16 cast, no optimizer state)."""

    def __init__(self, weights: list[torch.Tensor], mixed: bool):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(w) for w in weights)
        self.bf16 = nn.ParameterList(nn.Parameter(w.to(torch.bfloat16), requires_grad=False)
                                     for w in weights) if mixed else None


def large_state(model, opt, args, mixed: bool) -> tuple[Shard, torch.optim.Optimizer]:
    """A shard of a large model's size built from the trained state (module doc)."""
    n, rows, cols = args.shard
    params = list(model.parameters())

    def repeated(flats: list[torch.Tensor], offset: int) -> torch.Tensor:
        flat = torch.cat([f.reshape(-1) for f in flats]).numpy()
        return torch.from_numpy(np.resize(np.roll(flat, offset), rows * cols).reshape(rows, cols).copy())
    shard = Shard([repeated([p.detach() for p in params], i * 7919) for i in range(n)], mixed)
    adam = torch.optim.AdamW(list(shard.weights), lr=2e-3)
    for i, w in enumerate(shard.weights):
        adam.state[w] = {"step": torch.tensor(float(args.steps)),
                         "exp_avg": repeated([opt.state[p]["exp_avg"] for p in params], i * 7919),
                         "exp_avg_sq": repeated([opt.state[p]["exp_avg_sq"] for p in params], i * 7919)}
    return shard, adam


def durable_part(model, opt, args, work: Path) -> dict:
    dur = {f"toy {k}": v for k, v in durable_times(model, opt, args, work).items()}
    variants = [(None, 1), ("zstd", 1)] + ([("zstd", args.threads)] if args.threads > 1 else [])
    for mixed in (False, True):
        shard, adam = large_state(model, opt, args, mixed)
        name = "bf16 mixed" if mixed else "fp32"
        logical = sum(p.numel() * p.element_size() for p in shard.parameters()) + sum(
            t.numel() * t.element_size() for s in adam.state.values() for t in (s["exp_avg"], s["exp_avg_sq"]))
        got = durable_times(shard, adam, args, work, ("write-paced",), variants)
        dur.update({f"shard {name} ({logical / 1e6:.0f} MB) {k}": v for k, v in got.items()})
        del shard, adam
    for k, v in dur.items():
        plain = dur.get(k.rsplit(" ", 2)[0] + " plain") if not k.endswith("plain") else None
        ratio = f", {statistics.median(v['seconds']) / statistics.median(plain['seconds']):.2f}x plain" if plain else ""
        print(f"time to durable, {k}: {med(v['seconds'])} s{ratio}, files {v['file_bytes'] / 1e6:.2f} MB, flush "
              f"CPU {med(v['flush_cpu'])} s, load {v['load'][0]:.1f}-{v['load'][1]:.1f}")
    return dur


def fixtures_part(work: Path) -> dict:
    fx = fixtures(work)
    for name, row in fx.items():
        print(f"fixture {name}: {row['zstd']['logical']:,} B -> zstd {1 - row['zstd']['stored'] / row['zstd']['logical']:.1%}"
              f" smaller, lz4 {1 - row['lz4']['stored'] / row['lz4']['logical']:.1%}")
    return fx


def slices_part(model, args, work: Path) -> dict:
    sl = slices(model, args, work)
    for k, v in sl.items():
        if k != "shape":
            need = f"for {v['bytes_needed']:,} B needed ({v['bytes_read'] / v['bytes_needed']:.2f}x)" \
                if v["bytes_needed"] else "(no tile grid: units are flat)"
            print(f"{k.split()[0]} slice (a quarter of {sl['shape']}) {k.split()[1]}: read {v['bytes_read']:,} B "
                  f"{need}, {med([t * 1e3 for t in v['seconds']])} ms")
    return sl


if __name__ == "__main__":
    main()
