"""PyTorch DCP (torch.distributed.checkpoint) folders read in place, checked against torch's own tool.

The fixtures (tests/fixtures/dcp, made by make.py with torch 2.13 on CPU/gloo: FSDP2 dp=2, DTensor
TP tp=2, FSDP2 x TP on a (dp=2, tp=2) mesh) carry the ground truth torch itself produced:
``dcp_to_torch_save`` flattened to the DCP names (truth.safetensors, truth.json). None of it is made
by ucl, and no test here unpickles a truth file.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

import ucl
from corrupt import scramble
from ucl.errors import StoreError
from ucl.formats.dcp import read as dcp
from ucl.formats.registry import describe, detect_format

FIXTURES = Path(__file__).parent / "fixtures" / "dcp"
ALL = ["fsdp2_dp2", "tp2", "fsdp2_tp_2x2"]
OTHER_LAYOUT = {"fsdp2_dp2": "dp=3", "tp2": "tp=3", "fsdp2_tp_2x2": "dp=3,tp=2"}


def _truth(name: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    return load_file(str(FIXTURES / name / "truth.safetensors"))


def _dcp_name(key: str) -> str:
    kind, name = key.split("/", 1)
    return f"model.{name}" if kind == "param" else f"optim.state.{name}.{kind}"


def _assert_truth(path: Path, name: str) -> None:
    got = {_dcp_name(k): np.asarray(v) for k, v in ucl.load_rank(path, mesh="universal", rank=0).items()}
    truth = _truth(name)
    assert set(got) == set(truth)
    for k, want in truth.items():
        assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
        assert got[k].tobytes() == want.tobytes(), k


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


@pytest.mark.parametrize("name", ALL)
def test_load_rank_universal_equals_dcp_to_torch_save(name):
    assert detect_format(str(FIXTURES / name)) == "dcp"
    _assert_truth(FIXTURES / name, name)


@pytest.mark.parametrize("name", ALL)
def test_reshard_to_universal_and_through_another_layout(name, tmp_path):
    ucl.reshard(FIXTURES / name, tmp_path / "universal", to="universal", workers=1, durable=False)
    _assert_truth(tmp_path / "universal", name)
    ucl.reshard(FIXTURES / name, tmp_path / "other", to=OTHER_LAYOUT[name], workers=1, durable=False)
    ucl.reshard(tmp_path / "other", tmp_path / "back", to="universal", workers=1, durable=False)
    _assert_truth(tmp_path / "back", name)


SPECS = {
    "fsdp2_dp2": ("mesh dp", {"embed.weight": "split 0 over dp uneven", "scale": "split 0 over dp uneven",
                              "frozen": "split 0 over dp uneven", "pos": "replicate"}),
    "tp2": ("mesh tp", {"embed.weight": "split 0 over tp uneven", "fc2.weight": "split 1 over tp uneven",
                        "norm.weight": "replicate", "scale": "replicate"}),
    "fsdp2_tp_2x2": ("mesh dp, tp", {
        "embed.weight": "split 0 over tp uneven; split 0 over dp uneven",  # _StridedShard: FSDP2 over TP rows
        "fc2.weight": "split 0 over dp uneven; split 1 over tp uneven",
        "norm.weight": "split 0 over dp uneven", "pos": "replicate"}),
}


@pytest.mark.parametrize("name", ALL)
def test_the_layout_is_read_from_the_chunks(name):
    d = describe(FIXTURES / name)
    mesh_line, rules = SPECS[name]
    lines = d.spec.splitlines()
    assert mesh_line in lines
    for param, layout in rules.items():
        assert any(line.startswith(f"{param} [") and line.endswith(f": {layout}") for line in lines), param
    assert "state step : dtype float32; scalar" in lines
    assert set(d.frozen) == {"frozen", "pos"}
    assert d.params["embed.weight"] == (13, 10)
    # the description's ranks are torch's: every chunk a rank saved is that rank's own dataset
    for rank, table in enumerate(d.extents):
        for key in ("param/embed.weight", "exp_avg/fc2.weight"):
            assert table[key].file == f"__{rank}_0.distcp", (rank, key)
    groups = d.state["dcp"]["objects"]["optim"]["param_groups"]["0"]
    truth = json.loads((FIXTURES / name / "truth.json").read_text())
    assert groups["lr"] == truth["optim.param_groups.0.lr"] == 0.01
    assert groups["betas"] == truth["optim.param_groups.0.betas"]
    assert groups["params"] == truth["optim.param_groups.0.params"]


def test_a_rank_reads_only_its_chunks():
    stats = ucl.ops.IOStats()
    part = ucl.load_rank(FIXTURES / "fsdp2_tp_2x2", mesh="dp=2,tp=2", rank=1, stats=stats)
    truth = _truth("fsdp2_tp_2x2")
    # rank 1 = (dp 0, tp 1): TP rows [7, 13) of the embedding, FSDP2's first chunk of those: [7, 10)
    assert part["param/embed.weight"].tobytes() == truth["model.embed.weight"][7:10].tobytes()
    assert part["exp_avg/fc2.weight"].tobytes() == truth["optim.state.fc2.weight.exp_avg"][:5, 4:].tobytes()
    whole = sum(v.nbytes for v in truth.values())
    assert stats.bytes_read < 0.5 * whole


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ucl-pwned-by-dcp-metadata",))


@pytest.mark.parametrize("payload", [lambda: _Boom(), lambda: {"state_dict_metadata": {"x": _Boom()}}])
def test_a_metadata_pickle_that_runs_code_is_refused_and_runs_nothing(tmp_path, payload):
    folder = _copy("fsdp2_dp2", tmp_path)
    marker = "/tmp/ucl-pwned-by-dcp-metadata"
    if os.path.exists(marker):
        os.remove(marker)
    (folder / ".metadata").write_bytes(pickle.dumps(payload(), protocol=2))
    with pytest.raises(StoreError, match=r"(posix|os)\.system") as e:
        ucl.load_rank(folder, mesh="universal", rank=0)
    assert e.value.code == "UCL500"
    assert not os.path.exists(marker)


def test_the_metadata_allow_list_names_the_class(tmp_path):
    folder = _copy("tp2", tmp_path)
    data = (folder / ".metadata").read_bytes()
    # the same pickle, asking for a torch class that is not DCP metadata
    (folder / ".metadata").write_bytes(data.replace(b"torch.distributed.checkpoint.filesystem",
                                                    b"torch.distributed.checkpoint.fuzzsystem"))
    with pytest.raises(StoreError, match=r"fuzzsystem\._StorageInfo") as e:
        describe(folder)
    assert e.value.code == "UCL500"


def test_a_truncated_distcp_is_refused_before_anything_is_read(tmp_path, monkeypatch):
    folder = _copy("fsdp2_tp_2x2", tmp_path)
    f = folder / "__2_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    def no_parsing(*a, **k):
        raise AssertionError("an item was parsed before the sizes were checked")
    monkeypatch.setattr(dcp, "read_torch_file", no_parsing)
    with pytest.raises(StoreError, match=r"__2_0\.distcp.*truncated") as e:
        ucl.load_rank(folder, mesh="universal", rank=0)
    assert e.value.code == "UCL406"


def _edit_metadata(folder: Path, edit) -> None:
    torch = pytest.importorskip("torch")  # noqa: F841  (torch's own classes, to write a DCP metadata)
    with open(folder / ".metadata", "rb") as fh:
        md = pickle.load(fh)  # our own fixture, written by torch
    edit(md)
    with open(folder / ".metadata", "wb") as fh:
        pickle.dump(md, fh)


def test_chunks_no_split_gives_are_refused_naming_them(tmp_path):
    folder = _copy("fsdp2_dp2", tmp_path)

    def edit(md):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
        import torch
        md.state_dict_metadata["model.fc1.weight"].chunks = [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 10])),
            ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([5, 10]))]
        md.storage_data[MetadataIndex("model.fc1.weight", [3, 0])] = \
            md.storage_data.pop(MetadataIndex("model.fc1.weight", [4, 0]))
    _edit_metadata(folder, edit)
    with pytest.raises(StoreError, match=r"model\.fc1\.weight.*\[\[0, 0\], \[3, 0\]\].*\[3, 5\]") as e:
        describe(folder)
    assert e.value.code == "UCL502"


def test_compressed_items_are_refused(tmp_path):
    folder = _copy("tp2", tmp_path)

    def edit(md):
        info = next(iter(md.storage_data.values()))
        info.transform_descriptors = ["stream.zstd/1"]
    _edit_metadata(folder, edit)
    with pytest.raises(StoreError, match="zstd") as e:
        describe(folder)
    assert e.value.code == "UCL502"


def test_an_item_escaping_the_folder_is_refused(tmp_path):
    folder = _copy("tp2", tmp_path)

    def edit(md):
        info = next(iter(md.storage_data.values()))
        info.relative_path = "../outside.distcp"
    _edit_metadata(folder, edit)
    with pytest.raises(StoreError) as e:
        describe(folder)
    assert e.value.code == "UCL416"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_model_state_dict_saved_alone_in_one_process(tmp_path):
    """``dcp.save(model.state_dict())`` without a process group: bare names, one rank, several
    dtypes (bf16 kept as its bits), a 0-d tensor."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as tdcp
    from ucl.dtypes import to_numpy
    sd = {"w": torch.randn(5, 3), "b16": torch.randn(7).to(torch.bfloat16), "t": torch.tensor(3.5),
          "ids": torch.arange(4)}
    tdcp.save(sd, checkpoint_id=str(tmp_path / "ck"))
    d = describe(tmp_path / "ck")
    assert d.mesh == () and set(d.frozen) == set(sd)
    assert "state param for b16\n    : dtype bfloat16" in d.spec and "t [] : replicate" in d.spec
    got = ucl.load_rank(tmp_path / "ck", mesh="universal", rank=0)
    for k, v in sd.items():
        want, dtype = to_numpy(v)
        assert got[f"param/{k}"].tobytes() == want.tobytes() and got[f"param/{k}"].shape == want.shape, k


def _trained(torch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _same_as_torch(path, model, opt) -> None:
    """What ucl reads equals the live model and optimizer (the oracle: torch's own tensors)."""
    from ucl.dtypes import to_numpy
    got = ucl.load_rank(path, mesh="universal", rank=0)
    fqn = {id(p): n for n, p in model.named_parameters()}
    want = {f"param/{n}": v for n, v in model.state_dict().items()}
    want |= {f"{k}/{fqn[id(p)]}": v for p, st in opt.state.items() for k, v in st.items()}
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].tobytes() == to_numpy(v)[0].tobytes() and got[k].shape == tuple(v.shape), k


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_flattened_optimizer_state_is_read(tmp_path):
    """``get_state_dict(..., flatten_optimizer_state_dict=True)`` (what torchtitan's optimizer
    container saves): the state's path is ``("optim", "state.<fqn>.<kind>")``."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    model, opt = _trained(torch)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    tdcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ck"))
    _same_as_torch(tmp_path / "ck", model, opt)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torchtitan_layout_is_read_and_its_train_state_kept(tmp_path):
    """torchtitan's CheckpointManager: model keys at the top, the flattened optimizer under
    ``optimizer.``, and small tensors elsewhere (``train_state.step``) kept with the objects, bit for
    bit; ``ucl export dcp --style torchtitan`` of it reads back the same."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from ucl.formats.torchzip.plain import kept_tensor
    model, opt = _trained(torch)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    step = torch.tensor(7, dtype=torch.int32)
    tdcp.save({**msd, "optimizer": osd, "train_state": {"step": step}, "lr_scheduler": {"last_epoch": 7}},
              checkpoint_id=str(tmp_path / "titan"))
    _same_as_torch(tmp_path / "titan", model, opt)
    with ucl.open(tmp_path / "titan") as ck:
        objects = ck.state["dcp"]["objects"]
    array, dtype = kept_tensor(objects["train_state"]["step"])
    assert dtype == "int32" and array.shape == () and int(array) == 7
    assert objects["lr_scheduler"]["last_epoch"] == 7
    from ucl.ops.export import export_dcp
    export_dcp(tmp_path / "titan", tmp_path / "again", style="torchtitan")
    _same_as_torch(tmp_path / "again", model, opt)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_large_tensor_outside_model_and_optimizer_is_refused(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as tdcp
    model, _ = _trained(torch)
    tdcp.save({"model": model.state_dict(), "ema": {"w": torch.zeros(20000)}}, checkpoint_id=str(tmp_path / "ck"))
    with pytest.raises(StoreError, match=r"tensors outside the model and optimizer state \(ema.w\)"):
        describe(tmp_path / "ck")


def test_mutated_files_give_ucl_errors_only(tmp_path):
    """Bytes flipped or cut anywhere in .metadata or a .distcp: a UclError or a (possibly wrong)
    read, never another exception."""
    import random

    from ucl.errors import UclError
    from ucl.formats.registry import forget
    rng = random.Random(7)
    for i in range(40):
        folder = shutil.copytree(FIXTURES / "fsdp2_dp2", tmp_path / f"c{i}")
        scramble(folder / rng.choice([".metadata", "__0_0.distcp", "__1_0.distcp"]), rng)
        forget()
        try:
            ucl.load_rank(folder, mesh="universal", rank=0)
        except UclError:
            pass


def test_a_layout_of_more_ranks_than_writers_is_refused_before_it_is_built(tmp_path):
    """Chunk grids that multiply to more ranks than the processes whose __R_S.distcp files the
    folder holds (a 700 KB .metadata made 9 million) are refused before anything per rank."""
    folder = _copy("fsdp2_dp2", tmp_path)

    def edit(md):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
        import torch
        for key in ("model.fc1.weight", "optim.state.fc1.weight.exp_avg", "optim.state.fc1.weight.exp_avg_sq"):
            info = md.storage_data[MetadataIndex(key, [0, 0])]
            md.state_dict_metadata[key].chunks = [ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, 10]))
                                                  for i in range(8)]
            for i in range(8):
                md.storage_data[MetadataIndex(key, [i, 0])] = info
    _edit_metadata(folder, edit)
    with pytest.raises(StoreError, match=r"layout of 8 ranks.*written by 2 process") as e:
        describe(folder)
    assert e.value.code == "UCL502"


def test_a_huge_key_in_the_metadata_is_named_briefly(tmp_path):
    folder = _copy("tp2", tmp_path)
    huge = "k" * 100_000

    def edit(md):
        md.state_dict_metadata[huge] = md.state_dict_metadata.pop(next(iter(md.state_dict_metadata)))
    _edit_metadata(folder, edit)
    with pytest.raises(StoreError) as e:
        describe(folder)
    assert "kkkk" in str(e.value) and len(str(e.value)) < 1000
