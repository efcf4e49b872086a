"""Test helper: damage a checkpoint on disk the way a bad disk or a stray write would."""
import h5py


def flip_byte(path, key: str, offset: int = 100) -> None:
    """Invert one byte of dataset ``key`` (e.g. ``fp32/@flat0``) in the HDF5 file at ``path``."""
    with h5py.File(path, "r") as h:
        start = h[key].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(start + offset)
        b = fh.read(1)
        fh.seek(start + offset)
        fh.write(bytes([b[0] ^ 0xFF]))


def rewrite_pickle(pt, edit) -> None:
    """Replace the ``data.pkl`` of the ``torch.save`` file ``pt`` by ``edit(data)``, other members kept."""
    import zipfile
    with zipfile.ZipFile(pt) as z:
        items = [(i, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(pt, "w", zipfile.ZIP_STORED) as z:
        for info, data in items:
            z.writestr(info, edit(data) if info.filename.endswith("data.pkl") else data)


def scramble(path, rng) -> None:
    """Flip 1 to 4 random bytes of the file ``path``, and one time in five cut it short (``rng``: a
    ``random.Random``)."""
    data = bytearray(path.read_bytes())
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    path.write_bytes(bytes(data[: rng.randrange(len(data))] if rng.random() < 0.2 else data))


def without_offsets(ckpt) -> None:
    """Drop the manifest's byte offsets (``offset``, ``tables``) from checkpoint folder ``ckpt``, as
    ucl wrote it before offsets existed: every read then goes through HDF5's own metadata."""
    import json
    import os
    mpath = os.path.join(os.fspath(ckpt), "manifest.json")
    with open(mpath) as fh:
        m = json.load(fh)
    for entries in m["datasets"]:
        for e in entries.values():
            e.pop("offset", None)
            e.pop("tables", None)
    with open(mpath, "w") as fh:
        json.dump(m, fh)
