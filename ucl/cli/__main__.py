"""``python -m ucl.cli``: the command line."""
import sys

from . import entry

sys.exit(entry())
