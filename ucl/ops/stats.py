"""What an I/O operation did."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IOStats:
    """``bytes_needed`` counts the plan's boxes; ``bytes_read`` what was actually read from disk
    (verified reads round out to checksum chunks). A read-once ``load_rank`` also counts the bytes
    this process received from, and sent to, the other members of its replica groups over the
    process group: storage reads shrink to ``bytes_read``, the rest arrives as ``bytes_received``."""

    bytes_read: int = 0
    bytes_needed: int = 0
    bytes_written: int = 0
    datasets_written: int = 0
    seconds: float = 0.0
    compile_seconds: float = 0.0  # binding the spec and compiling the plan
    details: dict = field(default_factory=dict)
    bytes_received: int = 0
    bytes_sent: int = 0
    open_seconds: float = 0.0  # opening the source: a foreign folder's description (a derived spec imports transformers)

    def merge(self, other: "IOStats") -> None:
        self.bytes_read += other.bytes_read
        self.bytes_needed += other.bytes_needed
        self.bytes_written += other.bytes_written
        self.datasets_written += other.datasets_written
        self.bytes_received += other.bytes_received
        self.bytes_sent += other.bytes_sent
