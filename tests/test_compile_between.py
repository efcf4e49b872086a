"""Plans between two specs of the same tensors (``compile_between``, ``load_rank(model=...)``): the
result equals slicing the global tensors by hand (an oracle that does not use the compiler)."""
from __future__ import annotations

import numpy as np
import pytest

import ucl
from ucl.plan.compile import compile_between

ROWS = """mesh dp
w [10, 6] : split 0 over dp uneven
b [6] : replicate over dp
state exp_avg : follow
"""
COLS = """mesh tp
w [10, 6] : split 1 over tp
b [6] : split 0 over tp
state exp_avg : follow
"""
PARAMS = {"w": (10, 6), "b": (6,)}


def _model(text):
    return ucl.load_spec(text).bind({}, PARAMS)


def _global(seed=0):
    rng = np.random.default_rng(seed)
    return {f"{k}/{n}": rng.standard_normal(s).astype(np.float32) for n, s in PARAMS.items() for k in ("param", "exp_avg")}


def _chunk(n, parts, i):
    c = -(-n // parts)
    return slice(min(i * c, n), min((i + 1) * c, n))


@pytest.mark.parametrize("dp,tp", [(1, 1), (3, 2), (4, 3), (2, 6)])
def test_rows_to_columns_equals_slicing(dp, tp):
    A, B = _model(ROWS), _model(COLS)
    full = _global()
    rows = {r: {k: (v[_chunk(10, dp, r)] if k.endswith("/w") else v) for k, v in full.items()} for r in range(dp)}
    got = ucl.execute_memory(compile_between(A, f"dp={dp}", B, f"tp={tp}"), rows)
    for r in range(tp):
        for k, v in full.items():
            want = v[:, r * 6 // tp:(r + 1) * 6 // tp] if k.endswith("/w") else v[r * 6 // tp:(r + 1) * 6 // tp]
            assert np.array_equal(got[r][k], want), (r, k)


def test_load_rank_into_another_spec(tmp_path):
    A, B = _model(ROWS), _model(COLS)
    full = _global(1)
    shards = ucl.execute_memory(ucl.compile(A, "universal", "dp=3"), {0: full})
    path = ucl.save(tmp_path / "ck", shards, model=A, mesh="dp=3")
    for r in range(2):
        got = ucl.load_rank(path, mesh="tp=2", rank=r, model=B)
        assert np.array_equal(got["param/w"], full["param/w"][:, 3 * r:3 * r + 3])
        assert np.array_equal(got["exp_avg/b"], full["exp_avg/b"][3 * r:3 * r + 3])


def test_mismatched_tensors_are_named():
    A = _model(ROWS)
    other = ucl.load_spec(COLS.replace("w [10, 6]", "w [10, 3]")).bind({}, {"w": (10, 3), "b": (6,)})
    with pytest.raises(ucl.PlanError) as err:
        compile_between(A, "dp=2", other, "tp=1")
    assert err.value.code == "UCL316" and "param/w" in str(err.value) and "[10, 6]" in str(err.value)
    no_state = ucl.load_spec("mesh tp\nw : replicate\nb : replicate\nstate fp32 : follow\n").bind({}, PARAMS)
    with pytest.raises(ucl.PlanError) as err:
        compile_between(A, "dp=2", no_state, "tp=1")
    assert "fp32/" in str(err.value)
