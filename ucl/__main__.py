"""``python -m ucl``: the command line."""
import sys

from .cli import entry

sys.exit(entry())
