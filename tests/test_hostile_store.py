"""Hostile checkpoints: a checkpoint from anywhere is data, never a key (docs/security.md).

Each test damages a committed checkpoint of the demo model the way an attacker (or a careless
copy) would and checks the three promises: nothing outside the checkpoint is read, no reshard or
load succeeds with wrong data (the error names what is wrong; nothing is published), and only
UclErrors come out. The oracle is the undamaged source: a refusal, or the exact bytes.
"""
from __future__ import annotations

import json
import os
import shutil

import h5py
import numpy as np
import pytest

import ucl
from ucl.demo import llama_model, universal_state
from ucl.errors import UclError
from ucl.store import Checkpoint
from tests.corrupt import without_offsets

SRC_MESH = "dp=2,tp=2"
M = ucl.Mesh.parse
FC2 = "param/decoder.layers.0.mlp.linear_fc2.weight"     # [256, 352] bf16 per tp rank: chunked
PROJ = "param/decoder.layers.0.self_attention.linear_proj.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    model = llama_model()
    truth = universal_state(model, seed=0)
    root = tmp_path_factory.mktemp("pristine")
    shards = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, M(SRC_MESH)), {0: truth})
    src = ucl.save(root / "src", shards, model=model, mesh=SRC_MESH, state={"step": 7})
    uni = ucl.save(root / "uni", {0: truth}, model=model, mesh=ucl.UNIVERSAL, state={"step": 7})
    return {"src": src, "uni": uni, "shards": shards}


@pytest.fixture
def ckpt(pristine, tmp_path):
    """A private copy of the dp=2,tp=2 checkpoint to damage."""
    dst = tmp_path / "ck" / "src"
    shutil.copytree(pristine["src"], dst)
    return str(dst)


@pytest.fixture
def h5ckpt(ckpt):
    """The same copy as written before manifests recorded byte offsets: every read goes through HDF5's
    own metadata, where links, virtual datasets and digest attributes are the attack surface."""
    without_offsets(ckpt)
    return ckpt


def rank_file(path, rank):
    return os.path.join(path, f"rank_{rank:05d}.h5")


def edit_manifest(path, change):
    mp = os.path.join(path, "manifest.json")
    with open(mp) as f:
        d = json.load(f)
    change(d)
    with open(mp, "w") as f:
        json.dump(d, f)


def refused(call, code=None):
    with pytest.raises(UclError) as e:
        call()
    if code is not None:
        assert e.value.code == code, (e.value.code, str(e.value))
    return str(e.value)


def reshard_refused(path, tmp_path, code=None, to="tp=4"):
    """``ucl reshard`` refuses with ``code`` and publishes nothing."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    msg = refused(lambda: ucl.reshard(path, out / "dst", to=to, workers=1), code)
    assert os.listdir(out) == [], os.listdir(out)
    return msg


def loads_refused(path, code=None, mesh="tp=4"):
    """Every rank of ``mesh`` either refuses or returns exactly the truth; at least one refuses."""
    msgs = []
    for r in range(M(mesh).size):
        try:
            ucl.load_rank(path, mesh=mesh, rank=r)
        except UclError as e:
            if code is not None:
                assert e.code == code, (e.code, str(e))
            msgs.append(str(e))
    assert msgs, "no rank refused"
    return msgs[0]


def verify_complains(path, *needles):
    with ucl.open(path) as c:
        problems = c.verify()
    assert problems, "verify says ok"
    text = "\n".join(problems)
    for n in needles:
        assert n in text, (n, text)


# ---------------------------------------------------------------- 1. nothing outside is read

def _outside_copy(path, tmp_path, rank=1):
    """A byte-identical copy of a rank file outside the checkpoint (the attacker's bytes)."""
    out = tmp_path / "elsewhere"
    out.mkdir(exist_ok=True)
    dst = out / f"outside_{rank}.h5"
    shutil.copy(rank_file(path, rank), dst)
    return str(dst)


def _replace_with(path, rank, key, make):
    with h5py.File(rank_file(path, rank), "r+") as f:
        kind, name = key.split("/")
        attrs = dict(f[key].attrs)
        del f[kind][name]
        make(f, f[kind], name)
        for k, v in attrs.items():
            if k in f[key].attrs:
                continue
            try:
                f[key].attrs[k] = v
            except Exception:  # a link's attributes are its target's
                pass


def test_external_link_is_refused(h5ckpt, tmp_path):
    ckpt = h5ckpt
    outside = _outside_copy(ckpt, tmp_path)
    _replace_with(ckpt, 1, FC2, lambda f, g, n: g.__setitem__(n, h5py.ExternalLink(outside, "/" + FC2)))
    msg = reshard_refused(ckpt, tmp_path, "UCL416")
    assert "external link" in msg and "rank_00001.h5" in msg and FC2 in msg
    loads_refused(ckpt, "UCL416")
    verify_complains(ckpt, "external link")


def test_virtual_dataset_is_refused(h5ckpt, tmp_path):
    ckpt = h5ckpt
    outside = _outside_copy(ckpt, tmp_path)
    with h5py.File(outside, "r") as f:
        shape, dtype = f[FC2].shape, f[FC2].dtype

    def vds(f, g, n):
        layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
        layout[...] = h5py.VirtualSource(outside, FC2, shape=shape)
        g.create_virtual_dataset(n, layout)

    _replace_with(ckpt, 1, FC2, vds)
    assert "virtual dataset" in reshard_refused(ckpt, tmp_path, "UCL416")
    loads_refused(ckpt, "UCL416")
    verify_complains(ckpt, "virtual")


@pytest.mark.parametrize("kind", ["soft", "hard"])
def test_links_aliasing_another_dataset_are_refused(h5ckpt, tmp_path, kind):
    ckpt = h5ckpt
    # exp_avg's flat buffer made an alias of the fp32 master's (same shape, same dtype)
    def alias(f, g, n):
        g[n] = h5py.SoftLink("/fp32/@flat0") if kind == "soft" else f["fp32/@flat0"]

    _replace_with(ckpt, 0, "exp_avg/@flat0", alias)
    msg = reshard_refused(ckpt, tmp_path, "UCL416")
    assert ("soft link" if kind == "soft" else "hard links") in msg
    loads_refused(ckpt, "UCL416")
    verify_complains(ckpt, "UCL416" if False else "plain datasets")


def test_group_aliased_by_a_hard_link_is_refused(h5ckpt, tmp_path):
    ckpt = h5ckpt
    with h5py.File(rank_file(ckpt, 0), "r+") as f:
        del f["exp_avg_sq"]
        f["exp_avg_sq"] = f["exp_avg"]  # every exp_avg_sq dataset now reads exp_avg's bytes
    reshard_refused(ckpt, tmp_path, "UCL416")


def test_rank_file_symlinked_outside_is_refused(ckpt, tmp_path):
    outside = _outside_copy(ckpt, tmp_path)  # identical bytes: only where they live is wrong
    os.unlink(rank_file(ckpt, 1))
    os.symlink(outside, rank_file(ckpt, 1))
    msg = reshard_refused(ckpt, tmp_path, "UCL416")
    assert "outside" in msg
    loads_refused(ckpt, "UCL416")


def test_rank_file_symlinked_inside_is_read(ckpt, tmp_path):
    # a link that stays inside the checkpoint is harmless: the bytes are the checkpoint's own
    os.rename(rank_file(ckpt, 1), os.path.join(ckpt, "moved.h5"))
    os.symlink("moved.h5", rank_file(ckpt, 1))
    ucl.reshard(ckpt, tmp_path / "dst", to="tp=4", workers=1)
    with ucl.open(tmp_path / "dst") as c:
        assert c.verify() == []


# ---------------------------------------------------------------- 2. never wrong data

@pytest.mark.parametrize("a,b", [(0, 1), (0, 2)], ids=["tp-neighbours", "dp-neighbours"])
def test_swapped_rank_files_are_refused(ckpt, tmp_path, a, b):
    pa, pb = rank_file(ckpt, a), rank_file(ckpt, b)
    os.rename(pa, pa + ".x")
    os.rename(pb, pa)
    os.rename(pa + ".x", pb)
    msg = reshard_refused(ckpt, tmp_path)
    assert "rank_0000" in msg
    loads_refused(ckpt)
    # ranks store different datasets (replicas once): the swap shows as misplaced data or tables
    verify_complains(ckpt, "rank_0000")


def test_swapped_files_are_refused_even_without_chunk_bindings(h5ckpt, tmp_path):
    ckpt = h5ckpt
    # manifests written before the 'chunks' key: the chunk table is bound by hashing the dataset once
    edit_manifest(ckpt, lambda d: [e.pop("chunks", None) for r in d["datasets"] for e in r.values()])
    ucl.load_rank(ckpt, mesh="tp=4", rank=1)  # still loads when intact
    pa, pb = rank_file(ckpt, 0), rank_file(ckpt, 1)
    os.rename(pa, pa + ".x"), os.rename(pb, pa), os.rename(pa + ".x", pb)
    # a dataset the other rank does not store is missing (UCL406), one it does has other bytes (UCL407)
    assert "rank_0000" in reshard_refused(ckpt, tmp_path)
    loads_refused(ckpt)


def test_edited_manifest_checksum_is_refused(ckpt, tmp_path):
    def flip(d):
        e = d["datasets"][1][FC2]
        e["checksum"] = e["checksum"][:-1] + ("0" if e["checksum"][-1] != "0" else "1")

    edit_manifest(ckpt, flip)
    verify_complains(ckpt, "checksum mismatch")
    reshard_refused(ckpt, tmp_path, "UCL407")
    loads_refused(ckpt, "UCL407")


def test_spec_contradicting_stored_shapes_is_refused_before_reading(ckpt, tmp_path, monkeypatch, capsys):
    edit_manifest(ckpt, lambda d: d.update(spec=d["spec"].replace(
        "linear_proj.weight [hidden, heads * head_dim] : split 1 over tp",
        "linear_proj.weight [hidden, heads * head_dim] : split 0 over tp")))
    opened = []
    monkeypatch.setattr(Checkpoint, "_open_rank", lambda self, r: opened.append(r) or 1 / 0)
    msg = reshard_refused(ckpt, tmp_path, "UCL417")
    assert "linear_proj.weight" in msg and "[256, 128]" in msg and "[128, 256]" in msg, msg
    assert "nothing was read" in msg
    loads_refused(ckpt, "UCL417")
    assert opened == []
    monkeypatch.undo()
    import ucl.cli
    capsys.readouterr()
    assert ucl.cli.main(["verify", str(ckpt)]) == 1  # it said ok: every checksum matches
    out = capsys.readouterr().out
    assert "UCL417" in out and "linear_proj.weight" in out, out


def test_param_missing_from_params_is_refused(ckpt, tmp_path):
    edit_manifest(ckpt, lambda d: d["params"].pop("decoder.layers.3.mlp.linear_fc1.layer_norm_weight"))
    msg = reshard_refused(ckpt, tmp_path, "UCL417")
    assert "missing from the manifest's 'params'" in msg, msg


def test_frozen_parameter_with_optimizer_state_is_refused(pristine, tmp_path):
    path = tmp_path / "uni"
    shutil.copytree(pristine["uni"], path)
    edit_manifest(path, lambda d: d["frozen"].append("decoder.final_layernorm.weight"))
    msg = reshard_refused(str(path), tmp_path, "UCL417", to=SRC_MESH)
    assert "exp_avg/decoder.final_layernorm.weight" in msg and "frozen" in msg, msg


@pytest.mark.parametrize("what,attr,value", [("chunk", "ucl_chunk_bytes", 0), ("chunk", "ucl_chunk_bytes", 3),
                                             ("chunk", "ucl_chunks", np.zeros(3, np.uint64)),
                                             ("tile", "ucl_tiles", np.zeros((2, 4), np.uint64)),  # not the rule's grid
                                             ("tile", "ucl_tiles", np.zeros(8, np.uint64)),
                                             ("tile", "ucl_tiles", np.zeros(3, np.float64))])
def test_bad_checksum_table_attributes_are_refused(h5ckpt, tmp_path, what, attr, value):
    ckpt = h5ckpt
    with h5py.File(rank_file(ckpt, 1), "r+") as f:
        if what == "tile":
            assert "ucl_tiles" in f[FC2].attrs  # a 2-D dataset over 16 KiB carries tiles
        f[FC2].attrs[attr] = value
    msg = reshard_refused(ckpt, tmp_path, "UCL406")
    assert f"{what} checksum attributes" in msg
    loads_refused(ckpt, "UCL406")
    verify_complains(ckpt, f"{what} checksum")


def test_chunk_table_of_another_dataset_is_refused(h5ckpt, tmp_path):
    ckpt = h5ckpt
    # a consistent table, but copied from the other tp rank's copy of the dataset
    with h5py.File(rank_file(ckpt, 0), "r") as f:
        other = np.asarray(f[FC2].attrs["ucl_chunks"])
    with h5py.File(rank_file(ckpt, 1), "r+") as f:
        f[FC2].attrs["ucl_chunks"] = other
    loads_refused(ckpt, "UCL407")
    verify_complains(ckpt, "chunk checksums")


def test_tile_table_of_another_dataset_is_refused(h5ckpt, tmp_path):
    ckpt = h5ckpt
    # a well-formed tile table, but the other tp rank's: the manifest's 'tiles' digest catches it
    with h5py.File(rank_file(ckpt, 0), "r") as f:
        other = np.asarray(f[FC2].attrs["ucl_tiles"])
    with h5py.File(rank_file(ckpt, 1), "r+") as f:
        f[FC2].attrs["ucl_tiles"] = other
    reshard_refused(ckpt, tmp_path, "UCL407")
    loads_refused(ckpt, "UCL407")
    verify_complains(ckpt, "tile checksums")


def test_storage_beyond_the_end_of_the_file_is_refused(ckpt, tmp_path):
    p = rank_file(ckpt, 1)
    with h5py.File(p, "r") as f:
        end = f[FC2].id.get_offset() + f[FC2].id.get_storage_size()
    size = os.path.getsize(p)
    if end < size:  # cut the file just inside the dataset's bytes
        with open(p, "r+b") as fh:
            fh.truncate(end - 10)
    msg = reshard_refused(ckpt, tmp_path)
    assert "rank_00001.h5" in msg


# ---------------------------------------------------------------- 2b. byte offsets in the manifest

def test_hdf5_links_cannot_redirect_reads_that_go_by_offsets(ckpt, pristine, tmp_path):
    # the manifest says where the bytes are: an external link planted in the rank file is never
    # followed, the load returns the true bytes, and verify names the tampered dataset
    outside = _outside_copy(ckpt, tmp_path)
    _replace_with(ckpt, 1, FC2, lambda f, g, n: g.__setitem__(n, h5py.ExternalLink(outside, "/" + FC2)))
    os.unlink(outside)  # had it been followed, the read would fail
    got = ucl.load_rank(ckpt, mesh=SRC_MESH, rank=1)
    assert got[FC2].tobytes() == np.asarray(pristine["shards"][1][FC2]).tobytes()
    verify_complains(ckpt, "external link")


@pytest.mark.parametrize("value,code", [(-8, "UCL403"), ("0", "UCL403"), (True, "UCL403"), (10 ** 12, "UCL406")],
                         ids=["negative", "string", "bool", "past-the-end"])
def test_bad_data_offsets_are_refused(ckpt, tmp_path, value, code):
    edit_manifest(ckpt, lambda d: d["datasets"][1][FC2].__setitem__("offset", value))
    reshard_refused(ckpt, tmp_path, code)
    loads_refused(ckpt, code)


def test_offset_of_another_dataset_is_refused(ckpt, tmp_path):
    # the other tp rank's dataset of the same shape sits at the same offset of its own file: point
    # rank 1's entry at another dataset of this file instead; the checksums catch the wrong bytes
    with h5py.File(rank_file(ckpt, 1), "r") as f:
        other = int(f[PROJ].id.get_offset())
    edit_manifest(ckpt, lambda d: d["datasets"][1][FC2].__setitem__("offset", other))
    msg = reshard_refused(ckpt, tmp_path, "UCL407")
    assert "checksum" in msg and "rank_00001.h5" in msg and FC2 in msg
    loads_refused(ckpt, "UCL407")
    verify_complains(ckpt, "places its data")


@pytest.mark.parametrize("how", ["another-table", "past-the-end", "no-digest"])
def test_bad_table_offsets_are_refused(ckpt, tmp_path, how):
    def lie(d):
        e = d["datasets"][1][FC2]
        if how == "another-table":
            e["tables"] = d["datasets"][1][PROJ]["tables"]
        elif how == "past-the-end":
            e["tables"] = 10 ** 12
        else:
            del e["chunks"], e["tiles"]
    edit_manifest(ckpt, lie)
    code = {"another-table": "UCL407", "past-the-end": "UCL406", "no-digest": "UCL403"}[how]
    reshard_refused(ckpt, tmp_path, code)
    loads_refused(ckpt, code)


# ---------------------------------------------------------------- 3. bounded by the bytes there

def test_manifest_claiming_more_bytes_than_the_files_hold_is_refused(pristine, tmp_path):
    # a consistent lie: dims, params and datasets all claim a 10**9-row embedding (1 TB of state)
    path = tmp_path / "uni"
    shutil.copytree(pristine["uni"], path)
    name = "embedding.word_embeddings.weight"

    def lie(d):
        d["dims"]["vocab"] = 10 ** 9
        d["params"][name] = [10 ** 9, 256]
        d["params"]["output_layer.weight"] = [10 ** 9, 256]
        for key, e in d["datasets"][0].items():
            if (key.endswith("/" + name) or key.endswith("/output_layer.weight")) and e["shape"]:  # not step
                e["shape"] = [10 ** 9, 256]

    edit_manifest(path, lie)
    msg = refused(lambda: ucl.load_rank(path, mesh="tp=2", rank=0), "UCL406")
    assert "bytes" in msg and "manifest" in msg


@pytest.mark.parametrize("how", ["nan", "deep", "folder", "dev-zero", "fifo", "outside", "not-utf8"])
def test_unreadable_manifests_are_ucl_errors(ckpt, tmp_path, how):
    mp = os.path.join(ckpt, "manifest.json")
    text = open(mp).read()
    os.unlink(mp)
    if how == "nan":
        open(mp, "w").write(text.replace('"state":{"step":7}', '"state":{"step":NaN}'))
    elif how == "deep":
        open(mp, "w").write(text.replace('"state":{"step":7}', '"state":' + "[" * 100000 + "]" * 100000))
    elif how == "folder":
        os.mkdir(mp)
    elif how == "dev-zero":
        os.symlink("/dev/zero", mp)
    elif how == "fifo":
        os.mkfifo(mp)
    elif how == "outside":
        other = tmp_path / "manifest.json"
        other.write_text(text)
        os.symlink(other, mp)
    elif how == "not-utf8":
        open(mp, "wb").write(b"\xff\xfe" + text.encode())
    msg = refused(lambda: ucl.open(ckpt), "UCL401")
    assert "manifest" in msg
    refused(lambda: ucl.load_rank(ckpt, mesh="tp=4", rank=0), "UCL401")


def test_intact_checkpoint_still_loads_bit_exactly(ckpt, pristine):
    # the checks refuse only what is wrong: the undamaged copy reads back exactly
    got = ucl.load_rank(ckpt, mesh=SRC_MESH, rank=3)
    want = pristine["shards"][3]
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].tobytes() == np.asarray(want[k]).tobytes(), k


# ---------------------------------------------------------------- the command line

def test_cli_refuses_a_hostile_checkpoint_without_a_traceback(h5ckpt, tmp_path):
    ckpt = h5ckpt
    import subprocess
    import sys
    outside = _outside_copy(ckpt, tmp_path)
    _replace_with(ckpt, 1, FC2, lambda f, g, n: g.__setitem__(n, h5py.ExternalLink(outside, "/" + FC2)))
    for args in (["reshard", ckpt, str(tmp_path / "dst"), "--to", "tp=4"], ["verify", ckpt], ["inspect", ckpt]):
        r = subprocess.run([sys.executable, "-m", "ucl", *args], capture_output=True, text=True, timeout=120)
        assert "Traceback" not in r.stdout + r.stderr, r.stderr
        if args[0] != "inspect":  # inspect reads the manifest only
            assert r.returncode == 1 and "external link" in r.stdout + r.stderr, (args, r.stdout, r.stderr)
    assert not os.path.exists(tmp_path / "dst")


# ---------------------------------------------------------------- Hugging Face folders (ucl check --against)

def _safetensors(path, header: bytes, data: bytes = b""):
    import struct
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("how", ["index-outside", "index-absolute", "header-longer-than-file", "header-deep",
                                 "header-nan", "shard-fifo"])
def test_hostile_hugging_face_folders_are_ucl_errors(tmp_path, how):
    from ucl.formats.hf import read_tensor_names
    model = tmp_path / "model"
    model.mkdir()
    secret = tmp_path / "secret.safetensors"  # outside the folder: must never be read
    _safetensors(secret, b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4)
    good = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    if how.startswith("index"):
        name = "../secret.safetensors" if how == "index-outside" else str(secret)
        (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    elif how == "header-longer-than-file":
        import struct
        (model / "model.safetensors").write_bytes(struct.pack("<Q", 50 << 20) + good)
    elif how == "header-deep":
        _safetensors(model / "model.safetensors", b"[" * 100000 + b"]" * 100000)
    elif how == "header-nan":
        _safetensors(model / "model.safetensors", b'{"w":{"dtype":"F32","shape":[NaN],"data_offsets":[0,4]}}')
    elif how == "shard-fifo":
        (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "fifo.safetensors"}}))
        os.mkfifo(model / "fifo.safetensors")
    msg = refused(lambda: read_tensor_names(model), "UCL401")
    assert str(model) in msg or "model" in msg
