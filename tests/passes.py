"""The two test passes. The default one (`pytest tests`, the README's command) keeps a fast
representative of every area; the slow one (`UCL_SLOW_TESTS=1 pytest -m "slow or hypothesis"`,
`.ci/run`'s second pass) runs the `@pytest.mark.slow` tests and every property test again with
its full number of examples."""
from __future__ import annotations

import os

SLOW = bool(os.environ.get("UCL_SLOW_TESTS"))
SCALE = float(os.environ.get("UCL_PROPERTY_SCALE", "1"))  # e.g. 20 for a long fuzzing run
DEFAULT_SHARE = 0.2  # of a property test's examples in the default pass


def examples(n: int) -> int:
    """A property test's number of examples: ``n`` in the slow pass (times UCL_PROPERTY_SCALE), a
    fifth of it (at least 5) in the default one."""
    full = max(1, int(n * SCALE))
    return full if SLOW else min(full, max(5, int(full * DEFAULT_SHARE)))
