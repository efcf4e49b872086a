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
