"""The reader protocols have one contract each: ``CheckpointLike`` (a ucl checkpoint and a foreign
folder read in place answer the same calls) and the plan's ``Source`` (``read`` and ``read_into``).
A method whose signature drifts from its protocol in one class fails here, not in a user's reshard."""
from __future__ import annotations

import inspect

import pytest

from ucl.plan.execute import MemorySource, Source
from ucl.store.extents import ExtentCheckpoint
from ucl.store.like import CheckpointLike
from ucl.store.reader import Checkpoint
from ucl.store.source import StoreSource


def _members(protocol) -> dict[str, object]:
    skip = {"__init__", "__subclasshook__", "__class_getitem__", "__init_subclass__"}
    return {n: v for n, v in vars(protocol).items()
            if (callable(v) or isinstance(v, property)) and n not in skip and (not n.startswith("_")
                                                                             or n in ("__enter__", "__exit__"))}


def _parameters(f) -> list[tuple]:
    """(name, kind, default, annotation) of each parameter but ``self``; the return annotation is
    left out (each class names itself in ``__enter__``)."""
    sig = inspect.signature(f)
    return [(p.name, p.kind, p.default, p.annotation) for p in list(sig.parameters.values())[1:]]


@pytest.mark.parametrize("cls", [Checkpoint, ExtentCheckpoint])
def test_both_checkpoint_classes_have_every_method_of_the_protocol_with_its_signature(cls):
    members = _members(CheckpointLike)
    assert {"read", "read_runs", "read_box", "read_flat", "info", "keys", "verify", "nranks", "state"} <= set(members)
    for name, want in members.items():
        got = inspect.getattr_static(cls, name, None)
        assert got is not None, f"{cls.__name__} lacks {name}"
        if isinstance(want, property):
            assert isinstance(got, property), f"{cls.__name__}.{name} is not a property"
            continue
        assert _parameters(got) == _parameters(want), f"{cls.__name__}.{name}{inspect.signature(got)} " \
                                                      f"!= CheckpointLike.{name}{inspect.signature(want)}"


def test_the_protocol_names_the_attributes_both_classes_set():
    hints = CheckpointLike.__annotations__
    assert set(hints) == {"path", "manifest", "bytes_last_read"}
    for cls in (Checkpoint, ExtentCheckpoint):
        init = inspect.getsource(cls.__init__)
        for attr in hints:
            assert f"self.{attr}" in init, (cls.__name__, attr)


@pytest.mark.parametrize("cls", [MemorySource, StoreSource])
def test_every_plan_source_has_read_and_read_into_with_the_protocols_signature(cls):
    for name in ("read", "read_into"):
        got = getattr(cls, name)
        assert _parameters(got) == _parameters(getattr(Source, name)), f"{cls.__name__}.{name}"
