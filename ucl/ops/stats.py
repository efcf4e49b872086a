"""What an I/O operation did."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IOStats:
    """``bytes_needed`` counts the plan's boxes; ``bytes_read`` what was actually read from disk
    (verified reads round out to checksum chunks)."""

    bytes_read: int = 0
    bytes_needed: int = 0
    bytes_written: int = 0
    datasets_written: int = 0
    seconds: float = 0.0
    compile_seconds: float = 0.0
    details: dict = field(default_factory=dict)

    def merge(self, other: "IOStats") -> None:
        self.bytes_read += other.bytes_read
        self.bytes_needed += other.bytes_needed
        self.bytes_written += other.bytes_written
        self.datasets_written += other.datasets_written
