"""A stranger's pickle within a budget (docs/security.md): the `.pt` and DCP `.metadata` unpicklers
refuse, before building anything, what would crash the process (a tuple nested 200,000 deep used as a
dict key), hang it (tuple-hash and repr bombs, a list holding itself twice turned into JSON,
billion-laughs lists) or make it allocate gigabytes (one huge memo index); every case is one
UclError naming the file. The crashes and hangs run in a child under a memory and time limit."""
from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.passes import examples
from ucl.errors import StoreError, UclError
from ucl.files import parse_json
from ucl.formats.torchzip.read import read_torch_file
from ucl.formats.torchzip.plain import plain
from ucl.formats.torchzip.unpickle import PICKLE_BUDGET, PickleBudget, brief, scan

ROOT = Path(__file__).resolve().parent.parent
P = pickle  # opcodes


def _pt(path, payload: bytes) -> str:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/byteorder", "little")
    return str(path)


def _isolated(tmp_path, body: str, limit_gb: float = 1.5, timeout: float = 60) -> str:
    """Run ``body`` in a child Python with an address-space limit and a timeout; its stdout. A
    crash (SIGSEGV), a hang or an uncaught exception fails the test, never pytest itself."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import resource, sys
        limit = int({limit_gb} * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        sys.path.insert(0, {str(ROOT)!r})
    """) + textwrap.dedent(body))
    try:
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child ran past {timeout} s (a hang)")
    assert out.returncode == 0, f"child died with {out.returncode}: {out.stderr[-2000:]}"
    return out.stdout


def _read_refused(tmp_path, payload: bytes, **limits) -> str:
    """The one-line error reading ``payload`` as a `.pt` in a limited child."""
    path = _pt(tmp_path / "a.pt", payload)
    return _isolated(tmp_path, f"""
        from ucl.errors import UclError
        from ucl.formats.torchzip.read import read_torch_file
        from ucl.formats.torchzip.plain import plain
        try:
            tf = read_torch_file({path!r})
            plain(tf.obj, values=tf)
        except UclError as e:
            print(e.code, e)
        else:
            print("read")
    """, **limits)


def _deep_tuple_key(depth: int) -> bytes:
    return b"\x80\x02}" + b")" + b"\x85" * depth + b"Ns."  # {((((),),...),): None}


def _dag_tuple(width: int, levels: int) -> bytes:
    """A tuple of ``width`` references to one tuple of ``width`` references to ... (10^k to hash)."""
    out = b")"
    for i in range(levels):  # remember the last level, drop it from the stack, refer to it width times
        out += b"q" + bytes([i]) + b"0(" + (b"h" + bytes([i])) * width + b"t"
    return out


def test_a_tuple_nested_200000_deep_as_a_key_is_refused_not_a_crash(tmp_path):
    out = _read_refused(tmp_path, _deep_tuple_key(200_000))
    assert out.startswith("UCL500") and "a.pt" in out and "deep" in out


def test_a_tuple_hash_bomb_as_a_key_is_refused_at_once(tmp_path):
    key = b"\x80\x02}" + _dag_tuple(10, 12) + b"Ns."  # hashing it visits ~10^12 elements
    out = _read_refused(tmp_path, key, timeout=30)
    assert out.startswith("UCL500") and "a.pt" in out


def test_one_huge_memo_index_allocates_nothing(tmp_path):
    out = _read_refused(tmp_path, b"\x80\x02N" + b"r" + struct.pack("<I", 400_000_000) + b".", limit_gb=1.0)
    assert out.startswith("UCL500") and "memo slot 400,000,000" in out


def test_a_list_holding_itself_twice_is_refused_not_2_to_the_64_calls(tmp_path):
    a = []
    a += [a, a]
    out = _read_refused(tmp_path, pickle.dumps({"client_state": a}, protocol=2), timeout=30)
    assert out.startswith("UCL500") and "contains itself" in out and "a.pt" in out


def test_billion_laughs_lists_are_refused(tmp_path):
    x: list = ["lol"]
    for _ in range(30):
        x = [x] * 10
    out = _read_refused(tmp_path, pickle.dumps({"x": x}, protocol=2), timeout=30)
    assert out.startswith("UCL500") and "writes out more than" in out


def test_a_repr_bomb_in_an_error_message_is_bounded(tmp_path):
    # an unsupported persistent id that is a 10^12-element DAG of tuples: the message used str(pid)
    pid = _dag_tuple(10, 12)
    out = _read_refused(tmp_path, b"\x80\x02" + pid + b"Q.", timeout=30)
    assert out.startswith("UCL500") and len(out) < 600 and "MemoryError" not in out  # not its repr run out


def test_brief_is_bounded_on_cyclic_and_shared_values():
    a: list = []
    a += [a, a]
    x: list = [1]
    for _ in range(40):
        x = [x] * 10
    assert len(brief(a)) <= 200 and len(brief(x)) <= 200 and len(brief(10 ** 5000)) <= 200


def test_a_bytearray_in_a_bogus_encoding_is_a_one_line_error(tmp_path):
    payload = b"\x80\x02cbuiltins\nbytearray\nX\x01\x00\x00\x00aX\x05\x00\x00\x00bogus\x86R."
    with pytest.raises(StoreError, match="encoding") as e:
        read_torch_file(_pt(tmp_path / "a.pt", payload))
    assert e.value.code == "UCL500"


def test_an_encrypted_bit_in_the_zip_directory_is_a_one_line_error(tmp_path):
    path = Path(_pt(tmp_path / "a.pt", pickle.dumps({"a": 1}, protocol=2)))
    data = bytearray(path.read_bytes())
    at = data.index(b"PK\x01\x02")  # the central directory entry of data.pkl: general purpose flags at +8
    data[at + 8] |= 1
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="encrypted") as e:
        read_torch_file(str(path))
    assert e.value.code == "UCL500"


def test_build_cannot_rewrite_an_allowed_callable(tmp_path):
    """BUILD with slot state on a plain function would set its ``__defaults__`` for every later read."""
    payload = (b"\x80\x02ctorch._utils\n_rebuild_parameter\n"
               b"N}X\x0c\x00\x00\x00__defaults__(K\x01K\x02K\x03ts\x86b0N.")
    with pytest.raises(StoreError) as e:
        read_torch_file(_pt(tmp_path / "a.pt", payload))
    assert e.value.code == "UCL500"
    from ucl.formats.torchzip import read
    assert read._rebuild_parameter.__defaults__ == (False, None)


def test_dcp_metadata_goes_through_the_same_budget(tmp_path):
    (tmp_path / ".metadata").write_bytes(_deep_tuple_key(200_000))
    out = _isolated(tmp_path, f"""
        from ucl.errors import UclError
        from ucl.formats.dcp.metadata import read_metadata
        try:
            read_metadata({str(tmp_path)!r})
        except UclError as e:
            print(e.code, e)
    """)
    assert out.startswith("UCL500") and ".metadata" in out and "deep" in out


def test_plain_shares_converted_values_and_counts_them():
    shared = {"lr": 0.1}
    got = plain({"a": shared, "b": shared})
    assert got == {"a": {"lr": 0.1}, "b": {"lr": 0.1}}


def test_json_numbers_beyond_a_float_are_refused():
    err = lambda m: StoreError(m, code="UCL401")  # noqa: E731
    for text in ("1e400", '{"shape": [-1e400]}'):
        with pytest.raises(StoreError, match="beyond a float"):
            parse_json(text, "x", err)
    assert parse_json("[1e300, 2]", "x", err) == [1e300, 2]


def test_a_safetensors_shape_of_1e400_is_a_one_line_error(tmp_path):
    from ucl.formats.hf.names import read_tensor_names
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).replace("[2]", "[1e400]")
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0" * 8)
    with pytest.raises(StoreError) as e:
        read_tensor_names(path)
    assert e.value.code == "UCL401"


# ---- random pickles from the allowed opcodes ---------------------------------------------------------
_SMALL = PickleBudget(ops=4000, alloc=1 << 20, depth=24, tuple_work=2000, key_work=300, hash_work=5000, int_bits=256)
_PIECES = [b"(", b")", b"\x85", b"\x86", b"\x87", b"t", b"]", b"a", b"e", b"l", b"}", b"s", b"u", b"d", b"\x8f",
           b"\x90", b"\x91", b"0", b"1", b"2", b"N", b"\x88", b"K\x07", b"X\x01\x00\x00\x00k", b"\x94",
           b"cbuiltins\nset\n", b"cbuiltins\nfrozenset\n", b"ccollections\nOrderedDict\n", b"R", b"b",
           b"ctorch\nSize\n", b"\x8a\x09" + b"\xff" * 9]


@st.composite
def _pickles(draw) -> bytes:
    body = b""
    for _ in range(draw(st.integers(1, 120))):
        kind = draw(st.integers(0, len(_PIECES) + 2))
        if kind < len(_PIECES):
            body += _PIECES[kind]
        elif kind == len(_PIECES):
            body += b"q" + bytes([draw(st.integers(0, 255))])
        elif kind == len(_PIECES) + 1:
            body += b"h" + bytes([draw(st.integers(0, 8))])
        else:
            body += b"r" + struct.pack("<I", draw(st.sampled_from([0, 3, 200, 1 << 20, (1 << 32) - 1])))
    return b"\x80\x02" + body + b"."


def _tuple_shape(x, seen=None) -> tuple[int, int]:
    """(depth, elements with shared ones expanded) of a tuple tree, memoized."""
    seen = {} if seen is None else seen
    if type(x) is not tuple:
        return 0, 1
    if id(x) not in seen:
        parts = [_tuple_shape(c, seen) for c in x]
        seen[id(x)] = (1 + max((d for d, _ in parts), default=0), 1 + sum(w for _, w in parts))
    return seen[id(x)]


def _walk_tuples(x, out, seen):
    if id(x) in seen:
        return
    seen.add(id(x))
    if type(x) is tuple:
        out.append(x)
    for c in (x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple, set, frozenset)) else ()):
        _walk_tuples(c, out, seen)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(_pickles())
def test_random_pickles_are_an_error_or_within_the_budget(data):
    from ucl.formats.torchzip.read import _Unpickler  # noqa: PLC2701  the unpickler under test

    class Small(_Unpickler):
        def __init__(self, data, where):
            super().__init__(data, where)
            self.budget = _SMALL

    try:
        obj = Small(data, "random.pkl").load_checked()
    except UclError as e:
        assert "random.pkl" in str(e) and len(str(e)) < 600
        return
    tuples: list = []
    _walk_tuples(obj, tuples, set())
    shapes: dict = {}
    for t in tuples:
        depth, work = _tuple_shape(t, shapes)
        assert depth <= _SMALL.depth + 1 and work <= _SMALL.tuple_work + 1
    try:
        plain(obj)
    except UclError:
        pass


def test_the_budget_scan_accepts_what_the_pickler_writes():
    value = {"a": [1, 2.5, "x", (1, (2, 3))], "b": {(1, 2): None}, "c": [[]] * 3, "d": 10 ** 30}
    for protocol in range(0, 6):
        scan(pickle.dumps(value, protocol=protocol), "x", lambda m: StoreError(m, code="UCL500"), PICKLE_BUDGET)


def test_a_pickle_that_passed_is_still_refused_under_a_smaller_budget():
    """scan remembers bytes that passed by content and budget: never a pass across budgets."""
    data = pickle.dumps({"a": ((),) * 40}, protocol=2)
    scan(data, "x", lambda m: UclError(m))
    scan(data, "x", lambda m: UclError(m))
    with pytest.raises(UclError, match="tuple of 41 elements"):
        scan(data, "x", lambda m: UclError(m), PickleBudget(tuple_work=10))


def test_the_fast_opcodes_keep_the_general_checks():
    """MEMOIZE, BUILD, REDUCE, TUPLE1 and PUT with nothing above the mark, and a memo slot far ahead,
    are refused by the fast path as by the general one."""
    for body in (P.MARK + P.MEMOIZE, P.NONE + P.MARK + P.NONE + P.BUILD, P.MARK + P.TUPLE1,
                 P.NONE + P.MARK + P.NONE + P.REDUCE, P.MARK + P.BINPUT + b"\x00"):
        with pytest.raises(UclError, match="underflow"):
            scan(P.PROTO + b"\x04" + body + P.STOP, "x", lambda m: UclError(m))
    with pytest.raises(UclError, match="memo slot 200"):
        scan(P.PROTO + b"\x02" + P.NONE + P.BINPUT + b"\xc8" + P.STOP, "x", lambda m: UclError(m))
