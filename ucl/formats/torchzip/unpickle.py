"""Unpickling a stranger's bytes within a budget: the one unpickler of ``torchzip.read`` (``.pt``
archives) and ``dcp.metadata`` (DCP ``.metadata``).

The C unpickler cannot be bounded from Python while it runs: it hashes a dict key recursively (a
tuple nested 200,000 deep used as a key overflows the C stack; a DAG of tuples 10 wide costs 10^k),
it sizes its memo by the largest index a pickle names (30 bytes can make it allocate gigabytes), and
it builds whatever a few bytes describe. So :func:`scan` first walks the opcodes (no object is made:
a stack of small integers that records, per slot, a tuple's nesting and the elements hashing it
visits) and refuses, before anything is allocated:

- more than ``ops`` opcodes, or more than ``alloc`` bytes of memory at ``OP_BYTES`` an opcode (one
  small object, one container slot or one mark each; a container's elements are each at least one
  opcode, so this bounds container sizes and the objects made too);
- a tuple nested more than ``depth`` deep, or holding more than ``tuple_work`` elements with its
  shared ones expanded (what hashing or printing it visits: tuples do not cache their hash);
- a dict key or set member whose hash visits more than ``key_work`` elements, or more than
  ``hash_work`` for all of them together;
- a memo index beyond the bytes read so far (a pickler numbers its memo from 0, one opcode each);
- an integer longer than ``int_bits`` (so no later ``str()`` of one fails).

Then the C unpickler runs, with the subclass's allow-list; the callables it may call are
:class:`Call` objects, which no pickle can give state (BUILD) to. A violation or a malformed pickle
is ``error(message)`` naming the file. :func:`brief` is the bounded ``repr`` for messages."""
from __future__ import annotations

import io
import pickle
import pickletools
import reprlib
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import xxhash

from ...errors import StoreError, UclError

OP_BYTES = 64  # the most one opcode makes the process hold: one small object, one slot, or one mark


@dataclass(frozen=True)
class PickleBudget:
    """What one pickle may cost (docs/security.md); the defaults fit any real checkpoint's metadata."""
    ops: int = 1 << 25
    alloc: int = 2 << 30  # bytes: the pickle's own plus OP_BYTES an opcode
    depth: int = 128
    tuple_work: int = 1 << 16  # a tuple's elements, shared ones counted each time (its hash, its repr)
    key_work: int = 1 << 12
    hash_work: int = 1 << 24
    int_bits: int = 1 << 13


PICKLE_BUDGET = PickleBudget()

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxtuple, _REPR.maxlist, _REPR.maxdict = 3, 4, 4, 4
_REPR.maxset = _REPR.maxfrozenset = _REPR.maxdeque = _REPR.maxarray = 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 160, 40


def pickle_error(msg: str) -> StoreError:
    """A torch.save file or pickle ucl refuses to read (UCL500): the one error of this package's readers."""
    return StoreError(msg, code="UCL500")


def brief(value: Any) -> str:
    """A repr of a foreign value for a message, at most 200 characters and bounded work whatever it
    holds (nested, shared or cyclic containers, huge integers)."""
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001  a hostile value's repr may fail in any way; name its type only
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 200 else text[:197] + "..."


# what a malformed pickle raises inside the C unpickler, turned into one error naming the file
PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
                 AttributeError, LookupError, OverflowError, RecursionError, MemoryError, NotImplementedError,
                 struct.error, zlib.error, UnicodeError)


class Call:
    """An allow-listed callable handed to the unpickler: a pickle can call it, never set its state
    (BUILD on a plain function would set its attributes, ``__defaults__`` included)."""
    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]):
        object.__setattr__(self, "fn", fn)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError("a pickle tried to set the state of a callable")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(name)


# ---- the opcode scan ---------------------------------------------------------------------------------
_SHIFT = 40  # a tuple's stack slot: depth << _SHIFT | hash work; anything else's is 0
_WORK = (1 << _SHIFT) - 1
# kinds of opcode, by what they do to the stack (the commonest first: the scan tests them in order)
(PUSH, PUT, GET, MARK, TUPLE, TUPLE1, TUPLE2, TUPLE3, EMPTY_TUPLE, REDUCE, SETITEMS, APPENDS, ADDITEMS,
 LIST, DICT, FROZENSET, SETITEM, POP1, DUP, POP, POP_MARK, MEMOIZE, OBJ, NEWOBJ_EX, STACK_GLOBAL, REPLACE,
 LONG, STOP, NOTHING) = range(29)
_KINDS = {
    "MARK": MARK, "POP": POP, "POP_MARK": POP_MARK, "DUP": DUP, "TUPLE": TUPLE, "TUPLE1": TUPLE1,
    "TUPLE2": TUPLE2, "TUPLE3": TUPLE3, "EMPTY_TUPLE": EMPTY_TUPLE, "LIST": LIST, "DICT": DICT,
    "FROZENSET": FROZENSET, "APPEND": POP1, "APPENDS": APPENDS, "SETITEM": SETITEM, "SETITEMS": SETITEMS,
    "ADDITEMS": ADDITEMS, "GET": GET, "BINGET": GET, "LONG_BINGET": GET, "PUT": PUT, "BINPUT": PUT,
    "LONG_BINPUT": PUT, "MEMOIZE": MEMOIZE, "REDUCE": REDUCE, "NEWOBJ": REDUCE, "BUILD": POP1, "OBJ": OBJ,
    "INST": OBJ, "NEWOBJ_EX": NEWOBJ_EX, "STACK_GLOBAL": STACK_GLOBAL, "BINPERSID": REPLACE,
    "READONLY_BUFFER": NOTHING, "FRAME": NOTHING, "PROTO": NOTHING, "STOP": STOP, "LONG": LONG,
    "LONG1": LONG, "LONG4": LONG}
# the stack slots above the innermost mark a kind needs (fewer: the C unpickler's underflow error)
_NEED = {POP: 1, DUP: 1, PUT: 1, MEMOIZE: 1, TUPLE1: 1, TUPLE2: 2, TUPLE3: 3, REDUCE: 2, POP1: 2,
         SETITEM: 3, STACK_GLOBAL: 2, REPLACE: 1, NEWOBJ_EX: 3, STOP: 1}
# an opcode's argument: a fixed length >= 0, or pickletools' codes: -1 a line (GLOBAL and INST: two),
# -2 a 1-byte length, -3 a signed 4-byte one, -4 an unsigned 4-byte one, -5 an 8-byte one
_TABLE: list[tuple[int, int, int] | None] = [None] * 256
for _op in pickletools.opcodes:
    _kind = _KINDS.get(_op.name, PUSH)
    _arg = _op.arg.n if _op.arg is not None else 0
    _TABLE[_op.code.encode("latin-1")[0]] = (_kind, -6 if _op.name in ("GLOBAL", "INST") else _arg,
                                              _NEED.get(_kind, 0))
_U32, _I32, _U64 = struct.Struct("<I"), struct.Struct("<i"), struct.Struct("<Q")
# the commonest opcodes, taken first by one lookup (same checks as the general path): > 0 a push of
# fixed size (that many bytes, opcode included); the named negatives below
(_F_MEMOIZE, _F_GET4, _F_GET1, _F_TUPLE1, _F_MARK, _F_EMPTY_TUPLE, _F_REDUCE, _F_POP1, _F_SETITEMS, _F_TUPLE2,
 _F_TUPLE3, _F_PUT1, _F_PUT4, _F_PUSH_U32, _F_PUSH_U8) = range(-1, -16, -1)
_TUPLE_OF_SMALL = 1 << _SHIFT | 1  # a 1-tuple of a non-tuple (what tuple_of gives): depth 1, work 1
_FAST = [0] * 256
for _op in pickletools.opcodes:
    _c, _arg = _op.code.encode("latin-1")[0], _op.arg.n if _op.arg is not None else 0
    _kind = _KINDS.get(_op.name, PUSH)
    if _kind == PUSH and _arg >= 0:
        _FAST[_c] = 1 + _arg
    elif _kind == PUSH and _arg == -4:  # BINUNICODE, BINBYTES: a 4-byte unsigned length
        _FAST[_c] = _F_PUSH_U32
    elif (_kind == PUSH or _kind == LONG) and _arg == -2:  # a 1-byte length: LONG1's 255 bytes are within int_bits
        _FAST[_c] = _F_PUSH_U8
_FAST[pickle.BINPUT[0]], _FAST[pickle.LONG_BINPUT[0]] = _F_PUT1, _F_PUT4
_FAST[pickle.BINGET[0]], _FAST[pickle.LONG_BINGET[0]] = _F_GET1, _F_GET4
_FAST[pickle.MEMOIZE[0]], _FAST[pickle.TUPLE1[0]], _FAST[pickle.MARK[0]] = _F_MEMOIZE, _F_TUPLE1, _F_MARK
_FAST[pickle.EMPTY_TUPLE[0]], _FAST[pickle.BUILD[0]] = _F_EMPTY_TUPLE, _F_POP1
_FAST[pickle.REDUCE[0]], _FAST[pickle.NEWOBJ[0]] = _F_REDUCE, _F_REDUCE
_FAST[pickle.SETITEMS[0]], _FAST[pickle.TUPLE2[0]], _FAST[pickle.TUPLE3[0]] = _F_SETITEMS, _F_TUPLE2, _F_TUPLE3
_NO_FAST = [0] * 256


class _Scan:
    def __init__(self, where: str, error: Callable[[str], UclError], budget: PickleBudget, size: int):
        self.where, self.error, self.budget = where, error, budget
        self.max_ops = min(budget.ops, max(0, budget.alloc - size) // OP_BYTES)
        self.hashed = 0

    def refuse(self, what: str) -> None:
        raise self.error(f"{self.where}: the pickle {what}; ucl refuses it unread (docs/security.md)")

    def tuple_of(self, items: list[int]) -> int:
        depth, work = 0, 1
        for v in items:
            if v:
                depth, work = max(depth, v >> _SHIFT), work + (v & _WORK)
        if depth >= self.budget.depth:
            self.refuse(f"nests tuples more than {self.budget.depth} deep")
        if work > self.budget.tuple_work:
            self.refuse(f"builds a tuple of {work:,} elements with its shared ones expanded (at most "
                        f"{self.budget.tuple_work:,})")
        return (depth + 1) << _SHIFT | work

    def hashes(self, keys: list[int]) -> None:
        for v in keys:
            if v:
                work = v & _WORK
                if work > self.budget.key_work:
                    self.refuse(f"uses a key or set member whose hash visits {work:,} elements (at most "
                                f"{self.budget.key_work:,})")
                self.hashed += work
                if self.hashed > self.budget.hash_work:
                    self.refuse(f"hashes more than {self.budget.hash_work:,} elements in all")

    def run(self, data: bytes) -> None:  # noqa: C901  one loop, one branch per kind of opcode
        table, n, max_ops, int_bytes = _TABLE, len(data), self.max_ops, self.budget.int_bits // 8 + 1
        u32, i32, u64 = _U32.unpack_from, _I32.unpack_from, _U64.unpack_from
        stack: list[int] = []
        marks: list[int] = []
        memo: dict[int, int] = {}
        pos = ops = fence = 0
        counting = 1 if n > max_ops else 0
        fast = _NO_FAST if counting else _FAST  # the fast path counts no opcodes: only where none need counting
        while True:
            f = fast[data[pos]] if pos < n else 0
            if f:  # an IndexError or KeyError below (a truncated pickle, an unset memo slot) is an unreadable one
                if f > 0:
                    stack.append(0)
                    pos += f
                elif f == _F_MEMOIZE:
                    if len(stack) <= fence:
                        raise pickle.UnpicklingError(f"stack underflow at byte {pos}")
                    memo[len(memo)] = stack[-1]
                    pos += 1
                elif f == _F_TUPLE1:
                    if len(stack) <= fence:
                        raise pickle.UnpicklingError(f"stack underflow at byte {pos}")
                    v = stack[-1]
                    stack[-1] = self.tuple_of([v]) if v else _TUPLE_OF_SMALL
                    pos += 1
                elif f == _F_MARK:
                    fence = len(stack)
                    marks.append(fence)
                    pos += 1
                elif f == _F_EMPTY_TUPLE:
                    stack.append(1 << _SHIFT | 1)
                    pos += 1
                elif f == _F_SETITEMS:  # as in the general path; keys that are no tuples cost no hash work
                    if not marks:
                        raise pickle.UnpicklingError(f"no mark at byte {pos}")
                    m = marks.pop()
                    fence = marks[-1] if marks else 0
                    keys = stack[m::2]
                    if any(keys):
                        self.hashes(keys)
                    del stack[m:]
                    if not stack:
                        raise pickle.UnpicklingError("nothing to add items to")
                    pos += 1
                elif f == _F_TUPLE2 or f == _F_TUPLE3:
                    k = 2 if f == _F_TUPLE2 else 3
                    if len(stack) < fence + k:
                        raise pickle.UnpicklingError(f"stack underflow at byte {pos}")
                    items = stack[-k:]
                    stack[-k:] = [self.tuple_of(items) if any(items) else _TUPLE_OF_SMALL]
                    pos += 1
                elif f == _F_REDUCE or f == _F_POP1:  # REDUCE, NEWOBJ: as in the general path; BUILD
                    if len(stack) < fence + 2:
                        raise pickle.UnpicklingError(f"stack underflow at byte {pos}")
                    v = stack.pop()
                    if f == _F_REDUCE:
                        stack[-1] = v + 1 if v else 0
                    pos += 1
                elif f == _F_PUSH_U8:
                    stack.append(0)
                    pos += 2 + data[pos + 1]
                elif f == _F_PUSH_U32:
                    stack.append(0)
                    pos += 5 + u32(data, pos + 1)[0]
                elif f == _F_GET1:
                    stack.append(memo[data[pos + 1]])
                    pos += 2
                elif f == _F_GET4:
                    stack.append(memo[u32(data, pos + 1)[0]])
                    pos += 5
                else:
                    if len(stack) <= fence:
                        raise pickle.UnpicklingError(f"stack underflow at byte {pos}")
                    if f == _F_PUT1:
                        i = data[pos + 1]
                        pos += 2
                    else:
                        i = u32(data, pos + 1)[0]
                        pos += 5
                    if i > pos:
                        self.refuse(f"names memo slot {i:,} at byte {pos:,} (a pickler numbers them from 0)")
                    memo[i] = stack[-1]
                continue
            entry = table[data[pos]] if pos < n else None
            if entry is None:
                raise pickle.UnpicklingError(f"no valid opcode at byte {pos}")
            kind, arg, need = entry
            ops += counting  # a pickle of no more bytes than max_ops cannot run more opcodes: not counted
            if ops > max_ops:
                self.refuse(f"runs more than {max_ops:,} opcodes (at most {self.budget.ops:,}, and "
                            f"{self.budget.alloc:,} bytes of memory at {OP_BYTES} an opcode)")
            start = pos = pos + 1
            if arg > 0:
                pos += arg
            elif arg < 0:
                if arg == -4:
                    length = u32(data, pos)[0] + 4
                elif arg == -2:
                    length = data[pos] + 1
                elif arg == -1:
                    length = data.index(b"\n", pos) + 1 - pos
                elif arg == -6:
                    length = data.index(b"\n", data.index(b"\n", pos) + 1) + 1 - pos
                elif arg == -3:
                    length = i32(data, pos)[0]
                    if length < 0:
                        raise pickle.UnpicklingError("a negative length")
                    length += 4
                else:
                    length = u64(data, pos)[0] + 8
                if kind == LONG and length > int_bytes + 8:
                    self.refuse(f"holds an integer of {length:,} bytes (at most {self.budget.int_bits:,} bits)")
                pos += length
            if pos > n:
                raise pickle.UnpicklingError("the pickle ends inside an opcode's argument")
            if need and len(stack) < fence + need:
                if kind == POP and marks and marks[-1] == len(stack):  # POP takes a bare mark
                    marks.pop()
                    fence = marks[-1] if marks else 0
                    continue
                raise pickle.UnpicklingError(f"stack underflow at byte {start - 1}")
            if kind == PUSH or kind == LONG:
                stack.append(0)
            elif kind == PUT:
                i = data[start] if arg == 1 else u32(data, start)[0] if arg == 4 else int(data[start:pos - 1])
                if i > pos:  # a pickler numbers its memo from 0: an index below the opcodes so far
                    self.refuse(f"names memo slot {i:,} at byte {pos:,} (a pickler numbers them from 0)")
                memo[i] = stack[-1]
            elif kind == GET:
                i = data[start] if arg == 1 else u32(data, start)[0] if arg == 4 else int(data[start:pos - 1])
                stack.append(memo[i])
            elif kind == MARK:
                fence = len(stack)
                marks.append(fence)
            elif kind == TUPLE1:
                stack[-1] = self.tuple_of(stack[-1:])
            elif kind == TUPLE2:
                stack[-2:] = [self.tuple_of(stack[-2:])]
            elif kind == TUPLE3:
                stack[-3:] = [self.tuple_of(stack[-3:])]
            elif kind == EMPTY_TUPLE:
                stack.append(1 << _SHIFT | 1)
            elif kind == REDUCE:  # a callable's result: a tuple at most as deep as its arguments
                args = stack.pop()
                stack[-1] = args + 1 if args else 0
            elif kind <= FROZENSET:  # the kinds that end at a mark
                if not marks:
                    raise pickle.UnpicklingError(f"no mark at byte {start - 1}")
                m = marks.pop()
                fence = marks[-1] if marks else 0
                if kind == SETITEMS or kind == DICT:
                    self.hashes(stack[m::2])
                elif kind == ADDITEMS or kind == FROZENSET:
                    self.hashes(stack[m:])
                if kind == TUPLE:
                    v = self.tuple_of(stack[m:])
                    del stack[m:]
                    stack.append(v)
                else:
                    del stack[m:]
                    if kind == LIST or kind == DICT or kind == FROZENSET:
                        stack.append(0)
                    elif not stack:
                        raise pickle.UnpicklingError("nothing to add items to")
            elif kind == SETITEM:
                self.hashes(stack[-2:-1])
                del stack[-2:]
            elif kind == POP1 or kind == POP:
                stack.pop()
            elif kind == DUP:
                stack.append(stack[-1])
            elif kind == POP_MARK or kind == OBJ:
                if not marks:
                    raise pickle.UnpicklingError(f"no mark at byte {start - 1}")
                m = marks.pop()
                fence = marks[-1] if marks else 0
                if kind == OBJ and arg == 0 and len(stack) <= m:
                    raise pickle.UnpicklingError("OBJ without a class")
                del stack[m:]
                if kind == OBJ:
                    stack.append(0)
            elif kind == MEMOIZE:
                memo[len(memo)] = stack[-1]
            elif kind == NEWOBJ_EX:
                stack[-3:] = [0]
            elif kind == STACK_GLOBAL:
                stack[-2:] = [0]
            elif kind == REPLACE:
                stack[-1] = 0
            elif kind == STOP:
                if len(stack) != 1 or marks:
                    raise pickle.UnpicklingError("the pickle stops with a malformed stack")
                return
            # NOTHING (FRAME, PROTO, READONLY_BUFFER): no effect on the stack


# the pickles that passed the scan, by content and budget: a folder's files repeat the same small
# pickles (a DCP item's archive, per-rank files; the fixtures' 1,610 reads hold 157 distinct ones)
_PASSED: set[tuple[bytes, int, PickleBudget]] = set()
_PASSED_MAX = 1 << 14


def scan(data: bytes, where: str, error: Callable[[str], UclError], budget: PickleBudget = PICKLE_BUDGET) -> None:
    """Refuse ``data`` (``error`` naming ``where``) if unpickling it would break ``budget`` (see the
    module doc); nothing is unpickled. The same bytes are scanned once under one budget."""
    key = (xxhash.xxh3_128_digest(data), len(data), budget)
    if key in _PASSED:
        return
    try:
        _Scan(where, error, budget, len(data)).run(data)
    except UclError:
        raise
    except (pickle.UnpicklingError, ValueError, IndexError, KeyError, struct.error) as e:
        text = e.args[0] if e.args and isinstance(e.args[0], str) else type(e).__name__
        raise error(f"{where} is not a readable pickle: {text[:160]}") from None
    if len(_PASSED) >= _PASSED_MAX:
        _PASSED.clear()
    _PASSED.add(key)


class BudgetedUnpickler(pickle.Unpickler):
    """An allow-list unpickler within ``budget``: subclasses give ``find_class`` (returning
    :class:`Call` objects or classes) and ``persistent_load``, and :meth:`load_checked` scans then
    unpickles."""

    def __init__(self, data: bytes, where: str, error: Callable[[str], UclError],
                 budget: PickleBudget = PICKLE_BUDGET):
        super().__init__(io.BytesIO(data))
        self.data, self.where, self.error, self.budget = data, where, error, budget
        self.hashed = 0

    def load_checked(self) -> Any:
        """The pickle's object; any violation or malformation is ``error`` naming the file."""
        scan(self.data, self.where, self.error, self.budget)
        try:
            return self.load()
        except UclError:
            raise
        except PICKLE_ERRORS as e:
            text = e.args[0] if e.args and isinstance(e.args[0], str) else ""
            raise self.error(f"{self.where} is not a readable pickle: {type(e).__name__}: {text[:160]}") from None

    def refuse(self, what: str) -> None:
        raise self.error(f"{self.where}: the pickle {what}; ucl refuses it unread (docs/security.md)")

    def hash_check(self, items: list) -> None:
        """``items`` are about to be hashed by a set the pickle asked for: bound the work (a tuple's
        elements, shared ones counted each time: tuples do not cache their hash). The scan cannot see
        into a callable's arguments; the tuples there are at most ``depth`` deep (scanned)."""
        work: dict[int, int] = {}

        def cost(t: tuple) -> int:
            w = work.get(id(t))
            if w is None:
                w = work[id(t)] = 1 + sum(cost(c) if type(c) is tuple else 1 for c in t)
                if w > self.budget.key_work:
                    self.refuse(f"builds a set of a member whose hash visits {w:,} elements (at most "
                                f"{self.budget.key_work:,})")
            return w

        for x in items:
            if type(x) is tuple:
                self.hashed += cost(x)
                if self.hashed > self.budget.hash_work:
                    self.refuse(f"hashes more than {self.budget.hash_work:,} elements in all")

    def _items(self, items: Any) -> list:
        if not isinstance(items, (list, tuple, set, frozenset)):
            self.refuse("builds a set from something other than a list, tuple or set")
        items = list(items)
        self.hash_check(items)
        return items

    def checked_set(self, items: Any = ()) -> set:
        return set(self._items(items))

    def checked_frozenset(self, items: Any = ()) -> frozenset:
        return frozenset(self._items(items))
