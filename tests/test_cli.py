"""The `ucl` command line: every subcommand, its exit codes (0 ok, 1 user error with a clear
message and no traceback, 2 usage) and its output. Error exits run in a subprocess to see the real
stderr; the rest call ``ucl.cli.main`` in-process for speed."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import ucl
from tests.corrupt import flip_byte
import ucl.cli
from ucl.demo import LLAMA_MEGATRON, SMALL, llama_model, universal_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIMS = ",".join(f"{k}={v}" for k, v in SMALL.items())
SUBCOMMANDS = [["check"], ["plan"], ["reshard"], ["inspect"], ["verify"], ["demo"], ["spec"],
               ["spec", "list"], ["spec", "show"], ["spec", "from-hf"]]


def run_cli(*args, cwd=None):
    """`ucl ARGS` in a fresh interpreter: (exit code, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="200")
    p = subprocess.run([sys.executable, "-m", "ucl.cli", *map(str, args)], capture_output=True, text=True,
                       env=env, cwd=cwd, timeout=120)
    return p.returncode, p.stdout, p.stderr


def main(capsys, *args):
    """`ucl ARGS` in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        rc = ucl.cli.main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def run_either(capsys, real, *args):
    """In a real process (``real``) to see the genuine stderr, else in-process (an uncaught exception
    would fail the test there just as a traceback does here)."""
    return run_cli(*args) if real else main(capsys, *args)


def assert_clean_error(rc, out, err, *needles):
    assert rc == 1, (rc, out, err)
    assert "Traceback" not in out + err, err
    assert err.startswith("ucl: "), err
    for n in needles:
        assert n in err, (n, err)


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "llama.ucl").write_text(LLAMA_MEGATRON)
    bad = (LLAMA_MEGATRON.replace("split 1 over tp", "split 1 over tq")
           .replace("pad 0 to multiple_of(128 * tp)", "pad 0 to multiple_of(128 * tpp)"))
    (d / "bad.ucl").write_text(bad)
    (d / "syntax.ucl").write_text(LLAMA_MEGATRON.replace("mesh pp, dp, tp", "mesh pp, dp, tp\nfoo.weight [hidden] : frobnicate 0"))
    model = llama_model()
    truth = universal_state(model, seed=0)
    A = ucl.Mesh.parse("pp=2,dp=2,tp=2")
    shards = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, A), {0: truth})
    ucl.save(d / "src", shards, model=model, mesh=A, state={"step": 1000, "data_position": 42})
    return dict(dir=d, spec=d / "llama.ucl", bad=d / "bad.ucl", syntax=d / "syntax.ucl", src=d / "src",
                model=model, truth=truth)


def _read_all(path):
    with ucl.open(path) as c:
        return {r: {k: c.read(r, k) for k in c.keys(r)} for r in range(c.nranks)}


# ---------------------------------------------------------------- help and usage

def test_top_level_help_and_version(capsys):
    rc, out, _ = main(capsys, "--help")
    assert rc == 0
    for cmd in ("check", "plan", "reshard", "inspect", "verify", "demo", "spec"):
        assert cmd in out
    assert "pp=2,dp=2,tp=2" in out  # the mesh syntax is explained
    rc, out, _ = main(capsys, "--version")
    assert rc == 0 and out.strip() == f"ucl {ucl.__version__}"


@pytest.mark.parametrize("cmd", SUBCOMMANDS, ids=[" ".join(c) for c in SUBCOMMANDS])
def test_every_subcommand_has_help(capsys, cmd):
    rc, out, err = main(capsys, *cmd, "--help")
    assert rc == 0 and err == ""
    assert out.startswith(f"usage: ucl {' '.join(cmd)}"), out


@pytest.mark.parametrize("args", [
    [], ["bogus"], ["plan", "SPEC"], ["plan", "SPEC", "--dims", "a=1", "--from", "tp=2"], ["reshard", "a", "b"],
    ["reshard", "a", "b", "--to", "tp=2", "--workers", "many"], ["check"], ["verify"], ["inspect"],
    ["spec"], ["spec", "nope"], ["check", "x.ucl", "--bogus-flag"],
], ids=lambda a: " ".join(a) or "(none)")
def test_usage_errors_exit_2(capsys, args):
    rc, out, err = main(capsys, *args)
    assert rc == 2, (rc, out, err)
    assert "usage: ucl" in err and "Traceback" not in err


def test_usage_error_exit_2_in_a_real_process():
    rc, out, err = run_cli("plan", "x.ucl", "--dims", "a=1")
    assert rc == 2 and "usage: ucl plan" in err and "required" in err and "Traceback" not in err


# ---------------------------------------------------------------- check

def test_check_ok(capsys, files):
    rc, out, err = main(capsys, "check", files["spec"])
    assert rc == 0, err
    assert out.startswith("ok") and "axes pp, dp, tp" in out and "exp_avg" in out


def test_check_with_dims(capsys, files):
    rc, out, err = main(capsys, "check", files["spec"], "--dims", DIMS)
    assert rc == 0, err
    assert "27 parameters" in out and "135 tensors" in out


def test_check_errors_point_at_the_source_without_traceback(files):
    rc, out, err = run_cli("check", files["bad"], cwd=files["dir"])
    assert_clean_error(rc, out, err)
    lines = err.splitlines()
    assert "bad.ucl:14:96: error[UCL103]: unknown mesh axis 'tq'" in err
    assert "bad.ucl:10:79: error[UCL101]: unknown name 'tpp'" in err
    assert "did you mean tp?" in err
    assert "4 errors in " in err  # every problem at once
    # the offending source line is quoted with a caret under the culprit
    i = next(i for i, l in enumerate(lines) if "error[UCL103]" in l)
    src, caret = lines[i + 1], lines[i + 2]
    assert "split 1 over tq" in src
    assert caret.strip() == "^^" and src[caret.index("^"):caret.index("^") + 2] == "tq"


def test_check_syntax_error(files):
    rc, out, err = run_cli("check", files["syntax"])
    assert_clean_error(rc, out, err, "syntax.ucl:8:23: error[UCL002]", "frobnicate", "^^^^^^^^^^")


def test_check_missing_spec_file(capsys, files):
    rc, out, err = main(capsys, "check", files["dir"] / "nope.ucl")
    assert_clean_error(rc, out, err, "nope.ucl", "cannot read spec")


@pytest.mark.parametrize("dims,needle,real", [
    ("hidden", "cannot read dims", True),
    ("vocab=1000,hidden=abc", "cannot read dims", False),
    ("vocab=1000,hidden=256", "error[UCL", False),
])
def test_check_with_bad_dims(capsys, files, dims, needle, real):
    rc, out, err = run_either(capsys, real, "check", files["spec"], "--dims", dims)
    assert_clean_error(rc, out, err, needle)


def test_check_dims_that_do_not_bind(capsys, files):
    rc, out, err = main(capsys, "check", files["spec"], "--dims", DIMS.replace("heads=8", "heads=7"))
    assert rc == 1 and "error[UCL" in err


def test_check_against_a_checkpoint(capsys, files, tmp_path):
    pytest.importorskip("transformers")
    rc, out, err = main(capsys, "check", files["spec"], "--dims", DIMS, "--against", files["src"])
    assert rc == 0, (out, err)
    assert "ok" in out
    # a checkpoint of another model does not match
    other = dict(SMALL, ffn=352)
    m2 = llama_model(other)
    ucl.save(tmp_path / "small", {0: universal_state(m2, seed=1)}, model=m2, mesh=ucl.UNIVERSAL)
    rc, out, err = main(capsys, "check", files["spec"], "--dims", DIMS, "--against", tmp_path / "small")
    assert rc == 1 and "problem" in out and "linear_fc1.weight" in out


HF_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 99, "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2,
            "max_position_embeddings": 128, "tie_word_embeddings": False}


def test_spec_from_hf(capsys, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(dict(HF_LLAMA, head_dim=16)))
    rc, out, err = main(capsys, "spec", "from-hf", tmp_path / "config.json", "-o", tmp_path / "draft.ucl")
    assert rc == 0, err
    assert "draft spec written to" in out
    text = (tmp_path / "draft.ucl").read_text()
    assert "mesh" in text and "dims" in text
    rc, out, err = main(capsys, "check", tmp_path / "draft.ucl")
    assert rc == 0, err
    rc, out, err = main(capsys, "check", tmp_path / "draft.ucl", "--dims", tmp_path / "config.json")
    assert rc == 0, err
    rc, out2, err = main(capsys, "spec", "from-hf", tmp_path)
    assert rc == 0 and out2 == text


def test_spec_from_hf_then_check_with_the_same_config(capsys, tmp_path):
    """The command `ucl spec from-hf` suggests next (`ucl check DRAFT --dims CONFIG`) works on the config
    it drafted from, also when that config.json leaves a field (head_dim) to its class default."""
    pytest.importorskip("transformers")
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(HF_LLAMA))
    rc, out, err = main(capsys, "spec", "from-hf", tmp_path / "config.json", "-o", tmp_path / "draft.ucl")
    assert rc == 0, err
    rc, out, err = main(capsys, "check", tmp_path / "draft.ucl", "--dims", tmp_path / "config.json")
    assert rc == 0, err


def test_spec_from_hf_missing_config_exits_1(tmp_path):
    pytest.importorskip("transformers")
    rc, out, err = run_cli("spec", "from-hf", tmp_path / "nope.json")
    assert rc == 1 and "Traceback" not in err, err


def test_check_against_a_missing_path_exits_1(files):
    pytest.importorskip("transformers")
    rc, out, err = run_cli("check", files["spec"], "--dims", DIMS, "--against", files["dir"] / "missing")
    assert_clean_error(rc, out, err, "missing")


def test_check_against_without_dims_is_not_silently_ignored(capsys, files, tmp_path):
    pytest.importorskip("transformers")
    other = llama_model(dict(SMALL, ffn=352))
    ucl.save(tmp_path / "small", {0: universal_state(other, seed=1)}, model=other, mesh=ucl.UNIVERSAL)
    rc, out, err = main(capsys, "check", files["spec"], "--against", tmp_path / "small")
    assert rc != 0 or "match" in out, (rc, out, err)


# ---------------------------------------------------------------- plan

def test_plan_explain_and_json(capsys, files, tmp_path):
    pj = tmp_path / "plan.json"
    rc, out, err = main(capsys, "plan", files["spec"], "--dims", DIMS, "--from", "pp=2,dp=2,tp=2",
                        "--to", "pp=1,dp=2,tp=4", "--explain", "decoder.layers.1.mlp.linear_fc1.weight", "--json", pj)
    assert rc == 0, err
    assert "plan pp=2,dp=2,tp=2 -> pp=1,dp=2,tp=4" in out and "bytes read per target rank" in out
    # the explanation: SwiGLU [gate_r; up_r] -- target rank 0's second half comes from the up block
    assert "decoder.layers.1.mlp.linear_fc1.weight (param, bfloat16, global [1408, 256])" in out
    assert "[176:352, 0:256]" in out and "[704:880, 0:256]" in out
    assert "(exp_avg, float32" in out
    plan = ucl.Plan.from_json(pj.read_text())
    model = ucl.load_spec(str(files["spec"])).bind(SMALL, ucl.load_spec(str(files["spec"])).synthesize_params(SMALL))
    ref = ucl.compile(model, ucl.Mesh.parse("pp=2,dp=2,tp=2"), ucl.Mesh.parse("pp=1,dp=2,tp=4"))
    assert plan.src_mesh == ref.src_mesh and plan.dst_mesh == ref.dst_mesh and plan.rows == ref.rows
    for k in ref.copies:
        assert np.array_equal(plan.copies[k], ref.copies[k]), k
    assert plan.bytes_read == ref.bytes_read
    # the JSON plan runs: it reproduces the target layout from in-memory source shards
    truth = universal_state(model, seed=0)
    src = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, plan.src_mesh), {0: truth})
    got = ucl.execute_memory(plan, src)
    want = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, plan.dst_mesh), {0: truth})
    for r in want:
        for k in want[r]:
            assert np.array_equal(got[r][k], want[r][k]), (r, k)


def test_plan_to_universal(capsys, files):
    rc, out, err = main(capsys, "plan", files["spec"], "--dims", DIMS, "--from", "dp=2,tp=2", "--to", "universal")
    assert rc == 0, err
    assert "-> universal" in out


@pytest.mark.parametrize("args,needles,real", [
    (["--from", "pp=2,dp=2,tp=2", "--to", "pp=x"], ["cannot read mesh 'pp=x'", "pp=2,dp=2,tp=2"], True),
    (["--from", "pp=2;dp=2", "--to", "tp=2"], ["cannot read mesh"], False),
    (["--from", "pp=2,dp=2,tp=2", "--to", "tp=0"], ["tp=0", "positive"], False),
    (["--from", "pp=2,dp=2,tp=2", "--to", "zz=2"], ["'zz'", "not declared", "pp, dp, tp"], False),
    (["--from", "pp=2,dp=2,tp=2", "--to", "tp=3"], ["linear_qkv.weight", "[512, 256]", "tp=3", "uneven"], True),
    (["--from", "tp=2", "--to", "tp=4", "--explain", "no.such.param"], ["no.such.param"], False),
])
def test_plan_bad_mesh_or_param_exits_1(capsys, files, args, needles, real):
    rc, out, err = run_either(capsys, real, "plan", files["spec"], "--dims", DIMS, *args)
    assert_clean_error(rc, out, err, *needles)


def test_plan_json_to_an_unwritable_path_exits_1(files, tmp_path):
    rc, out, err = run_cli("plan", files["spec"], "--dims", DIMS, "--from", "tp=2", "--to", "tp=4",
                           "--json", tmp_path / "no" / "such" / "dir" / "p.json")
    assert_clean_error(rc, out, err, "p.json")


def test_plan_params_from_a_missing_path_exits_1(files, tmp_path):
    pytest.importorskip("transformers")
    rc, out, err = run_cli("plan", files["spec"], "--dims", DIMS, "--from", "tp=2", "--to", "tp=4",
                           "--params", tmp_path / "missing")
    assert_clean_error(rc, out, err, "missing")


def test_plan_params_from_a_checkpoint(capsys, files):
    pytest.importorskip("transformers")
    rc, out, err = main(capsys, "plan", files["spec"], "--dims", DIMS, "--from", "pp=2,dp=2,tp=2", "--to", "tp=4",
                        "--params", files["src"])
    assert rc == 0, err
    assert "plan pp=2,dp=2,tp=2 -> tp=4" in out


# ---------------------------------------------------------------- reshard, inspect, verify

def test_reshard_quiet(capsys, files, tmp_path):
    rc, out, err = main(capsys, "reshard", files["src"], tmp_path / "dst", "--to", "pp=1,dp=2,tp=4", "--quiet")
    assert rc == 0, err
    assert f"wrote {tmp_path / 'dst'} (pp=1,dp=2,tp=4)" in out and "datasets" in out
    model, truth = files["model"], files["truth"]
    want = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, ucl.Mesh.parse("pp=1,dp=2,tp=4")), {0: truth})
    stored = _read_all(tmp_path / "dst")  # replicas only on their first holder: a subset, bit-exact
    assert sorted(stored) == sorted(want)
    assert all(stored[r][k].tobytes() == want[r][k].tobytes() for r in stored for k in stored[r])
    got = {r: ucl.load_rank(tmp_path / "dst", mesh="pp=1,dp=2,tp=4", rank=r) for r in want}
    for r in want:
        assert sorted(got[r]) == sorted(want[r])
        for k in want[r]:
            assert got[r][k].tobytes() == want[r][k].tobytes(), (r, k)
    with ucl.open(tmp_path / "dst") as c:
        assert c.state == {"step": 1000, "data_position": 42}
    # and back to universal with one worker
    rc, out, err = main(capsys, "reshard", tmp_path / "dst", tmp_path / "uni", "--to", "universal", "--quiet",
                        "--workers", "1")
    assert rc == 0, err
    got = _read_all(tmp_path / "uni")
    assert sorted(got[0]) == sorted(truth)
    for k in truth:
        assert got[0][k].tobytes() == truth[k].tobytes(), k


def test_reshard_with_progress_bar(capsys, files, tmp_path):
    rc, out, err = main(capsys, "reshard", files["src"], tmp_path / "dst", "--to", "tp=2")
    assert rc == 0, err
    assert "wrote" in out


@pytest.mark.parametrize("to,needles,real", [
    ("pp=2,dp=x", ["cannot read mesh 'pp=2,dp=x'"], True),
    ("tp=3", ["linear_qkv.weight", "tp=3"], False),
    ("ep=2", ["'ep'", "not declared"], False),
])
def test_reshard_bad_mesh_exits_1_and_writes_nothing(capsys, files, tmp_path, to, needles, real):
    rc, out, err = run_either(capsys, real, "reshard", files["src"], tmp_path / "dst", "--to", to, "--quiet")
    assert_clean_error(rc, out, err, *needles)
    assert os.listdir(tmp_path) == []


def test_reshard_refuses_an_existing_target(files, tmp_path):
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("mine")
    rc, out, err = run_cli("reshard", files["src"], tmp_path / "dst", "--to", "tp=2", "--quiet")
    assert_clean_error(rc, out, err, "already exists")
    assert os.listdir(tmp_path / "dst") == ["keep.txt"] and (tmp_path / "dst" / "keep.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["dst"]


def test_reshard_missing_source(capsys, tmp_path):
    rc, out, err = main(capsys, "reshard", tmp_path / "nope", tmp_path / "dst", "--to", "tp=2", "--quiet")
    assert_clean_error(rc, out, err, "nope", "does not exist")


def test_inspect(capsys, files):
    rc, out, err = main(capsys, "inspect", files["src"])
    assert rc == 0, err
    assert "ucl format v2" in out and "layout pp=2,dp=2,tp=2 (8 rank files)" in out
    assert "spec demo:llama_megatron" in out
    assert "hidden=256" in out and "kv_heads=4" in out
    assert '"step": 1000' in out
    assert "decoder.layers.3.mlp.linear_fc1.weight" in out and "[1408, 256]" in out
    assert "split 0.1 over tp" in out and "param (bfloat16)" in out and "exp_avg (float32)" in out
    assert "rank 0 (" not in out


def test_inspect_ranks(capsys, files):
    rc, out, err = main(capsys, "inspect", files["src"], "--ranks")
    assert rc == 0, err
    for r in range(8):
        assert f"rank {r} (rank_{r:05d}.h5):" in out
    assert "fp32/@flat0" in out and "param/decoder.layers.1.self_attention.linear_qkv.weight" in out
    # pp=2: rank 5 (last stage, dp=0, tp=1) stores the output layer with local layer numbers 0..1;
    # rank 7, its dp replica, stores only its own parts of the flat optimizer buffers
    last = out[out.index("rank 5 (rank_00005.h5):"):out.index("rank 6 (rank_00006.h5):")]
    assert "param/output_layer.weight" in last and "decoder.layers.2." not in last
    tail = out[out.index("rank 7 (rank_00007.h5):"):]
    assert "fp32/@flat0" in tail and "param/" not in tail


def test_inspect_not_a_checkpoint(capsys, tmp_path):
    rc, out, err = main(capsys, "inspect", tmp_path)
    assert_clean_error(rc, out, err, "manifest.json")


def test_verify_ok(capsys, files):
    rc, out, err = main(capsys, "verify", files["src"])
    assert rc == 0, err
    assert "ok" in out and "checksum" in out


def test_verify_corrupt_dataset_exits_1_naming_it(files, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(files["src"], bad)
    flip_byte(bad / "rank_00005.h5", "exp_avg/@flat0")
    rc, out, err = run_cli("verify", bad)
    assert rc == 1, (out, err)
    assert "Traceback" not in out + err
    assert "checksum mismatch" in out and "rank_00005.h5" in out and "exp_avg/@flat0" in out
    assert "1 problem(s)" in out


def test_verify_truncated_file_exits_1_naming_it(files, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(files["src"], bad)
    f = bad / "rank_00003.h5"
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 3)
    (bad / "rank_00006.h5").unlink()
    rc, out, err = run_cli("verify", bad)
    assert rc == 1 and "Traceback" not in out + err
    assert "rank_00003.h5" in out and "rank_00006.h5" in out and "2 problem(s)" in out


def test_verify_newer_version_and_missing_manifest(files, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(files["src"], bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["version"] = ucl.store.READ_VERSION + 1
    (bad / "manifest.json").write_text(json.dumps(m))
    rc, out, err = run_cli("verify", bad)
    assert_clean_error(rc, out, err, "newer")
    (bad / "manifest.json").unlink()
    rc, out, err = run_cli("verify", bad)
    assert_clean_error(rc, out, err, "manifest.json")


# ---------------------------------------------------------------- demo, spec

def test_demo(capsys, tmp_path):
    rc, out, err = main(capsys, "demo", "--workdir", tmp_path)
    assert rc == 0, (out, err)
    assert "bit-exact" in out and "MISMATCH" not in out
    assert list(tmp_path.iterdir()) == []  # nothing kept


def test_demo_other_meshes_keep(capsys, tmp_path):
    rc, out, err = main(capsys, "demo", "--workdir", tmp_path, "--from", "dp=3", "--to", "pp=4,tp=2", "--keep")
    assert rc == 0, (out, err)
    assert "bit-exact" in out and "dp=3 -> pp=4,tp=2" in out
    (run,) = list(tmp_path.iterdir())
    assert sorted(p.name for p in run.iterdir()) == ["roundtrip", "source", "target", "universal"]


def test_demo_bad_mesh_exits_1(capsys):
    rc, out, err = main(capsys, "demo", "--to", "tp=3")
    assert_clean_error(rc, out, err, "tp=3")


def test_spec_list(capsys):
    rc, out, err = main(capsys, "spec", "list")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines == sorted(lines)
    assert all(l.startswith("stdlib:") for l in lines)
    # every listed spec loads and passes `check`
    for l in lines[:3]:
        rc, o, e = main(capsys, "check", l)
        assert rc == 0, (l, e)


def test_spec_show(capsys, files):
    rc, out, err = main(capsys, "spec", "show", files["spec"])
    assert rc == 0, err
    assert out == LLAMA_MEGATRON
    rc, out, err = main(capsys, "spec", "list")
    names = out.split()
    if names:
        rc, out, err = main(capsys, "spec", "show", names[0])
        assert rc == 0 and "mesh" in out


def test_spec_show_unknown_stdlib_name():
    rc, out, err = run_cli("spec", "show", "stdlib:nope")
    assert_clean_error(rc, out, err, "no standard spec named 'nope'", "available")


# ---------------------------------------------------------------- clear messages for common mistakes

LLAMA_DIMS = dict(vocab=99, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, layers=8, tied=0)


def _dims_text(d):
    return ",".join(f"{k}={v}" for k, v in d.items())


def test_plan_with_missing_dims_names_them_in_one_error():
    rc, out, err = run_cli("plan", "stdlib:llama", "--dims", "hidden=64", "--from", "tp=1", "--to", "tp=2")
    assert_clean_error(rc, out, err, "error[UCL209]: dims not given: vocab (vocab_size), heads (num_attention_heads)",
                       "layers (num_hidden_layers)", "tied (tie_word_embeddings)", "1 error in stdlib:llama")
    assert err.count("error[") == 1, err
    assert "unknown name" not in err and "UCL101" not in err and "UCL212" not in err, err
    assert "hidden (" not in err  # given


def test_check_with_a_mistyped_dim_names_the_missing_one_and_suggests(capsys, files):
    rc, out, err = main(capsys, "check", files["spec"], "--dims", DIMS.replace("hidden=", "hiden="))
    assert_clean_error(rc, out, err, "dims not given: hidden (hidden_size)", "unknown dim 'hiden'",
                       "did you mean hidden?", "2 errors in")
    assert "unknown name" not in err, err


@pytest.mark.parametrize("dims,real", [("nosuch.json", True), ("configs/llama", False), ("./llama/config.json", False)])
def test_dims_naming_a_missing_file_says_so(capsys, files, dims, real):
    rc, out, err = run_either(capsys, real, "plan", files["spec"], "--dims", dims, "--from", "tp=1", "--to", "tp=2")
    assert_clean_error(rc, out, err, f"--dims {dims}: no such file or folder", "config.json")
    assert "cannot read dims" not in err, err


def test_check_a_folder_says_it_is_a_folder(files):
    rc, out, err = run_cli("check", files["dir"])
    assert_clean_error(rc, out, err, str(files["dir"]), "is a folder, not a spec file")


@pytest.mark.parametrize("cmd", ["inspect", "verify"])
@pytest.mark.parametrize("name", ["rank_00000.h5", "manifest.json"])
def test_a_file_inside_a_checkpoint_names_the_folder_to_pass(capsys, files, cmd, name):
    real = cmd == "inspect" and name == "rank_00000.h5"
    rc, out, err = run_either(capsys, real, cmd, files["src"] / name)
    assert_clean_error(rc, out, err, f"{files['src'] / name} is a file inside the checkpoint {files['src']}",
                       "pass the checkpoint folder")
    assert "does not exist" not in err, err


def test_reshard_from_a_rank_file_names_the_folder(capsys, files, tmp_path):
    rc, out, err = main(capsys, "reshard", files["src"] / "rank_00001.h5", tmp_path / "dst", "--to", "tp=2")
    assert_clean_error(rc, out, err, "is a file inside the checkpoint", str(files["src"]))
    assert os.listdir(tmp_path) == []


def test_inspect_a_plain_file(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    rc, out, err = main(capsys, "inspect", tmp_path / "notes.txt")
    assert_clean_error(rc, out, err, "notes.txt is a file, not a checkpoint", "manifest.json")


@pytest.mark.parametrize("n", ["0", "-3"])
def test_workers_must_be_positive_usage_error(capsys, files, tmp_path, n):
    rc, out, err = main(capsys, "reshard", files["src"], tmp_path / "dst", "--to", "tp=2", "--workers", n)
    assert rc == 2, (rc, out, err)
    assert "usage: ucl reshard" in err and "--workers" in err and "at least 1" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_demo_bad_mesh_fails_before_writing(tmp_path):
    rc, out, err = run_cli("demo", "--workdir", tmp_path / "work", "--to", "tp=3")
    assert_clean_error(rc, out, err, "tp=3", "linear_qkv.weight", "error[UCL204]")
    assert not (tmp_path / "work").exists() or os.listdir(tmp_path / "work") == [], os.listdir(tmp_path / "work")


def test_spec_from_hf_config_without_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in HF_LLAMA.items() if k != "model_type"}))
    rc, out, err = run_cli("spec", "from-hf", tmp_path / "config.json")
    assert_clean_error(rc, out, err, "has no model_type", '"model_type": "llama"')
    assert "KeyError" not in err and len(err.strip().splitlines()) == 1, err


def test_spec_from_hf_unknown_model_type_is_one_short_line(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(dict(HF_LLAMA, model_type="lama")))
    rc, out, err = run_cli("spec", "from-hf", tmp_path)
    assert_clean_error(rc, out, err, "unknown model_type 'lama'", "model types", "did you mean llama?")
    assert len(err.strip().splitlines()) == 1 and len(err) < 400, err
    (tmp_path / "config.json").write_text(json.dumps(dict(HF_LLAMA, model_type="zzz_not_a_model")))
    rc, out, err = run_cli("spec", "from-hf", tmp_path)
    assert_clean_error(rc, out, err, "unknown model_type 'zzz_not_a_model'", "e.g. llama")
    assert len(err.strip().splitlines()) == 1 and len(err) < 400, err


def _fake_model_folder(path, params):
    """A folder `--against` reads names and shapes from: a ucl manifest with `params`."""
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({"params": {n: list(s) for n, s in params.items()}}))
    return path


def test_check_against_prints_each_problem_once_with_its_rule(capsys, tmp_path):
    spec = ucl.load_spec("stdlib:llama")
    model = _fake_model_folder(tmp_path / "model", spec.synthesize_params(LLAMA_DIMS))
    wrong = _dims_text(dict(LLAMA_DIMS, ffn=172))
    rc, out, err = main(capsys, "check", "stdlib:llama", "--dims", wrong, "--against", model)
    assert rc == 1, (out, err)
    assert "error: error" not in out and "error[" not in out, out
    lines = out.splitlines()
    firsts = [l for l in lines if l.startswith("error: ")]
    assert len(firsts) == 3, out  # gate, up and down projections: one line each, not one per layer
    assert ("error: parameter 'model.layers.0.mlp.down_proj.weight' has shape [64, 128], but the rule declares "
            "dim 1 = 172 [UCL203]") in lines, out
    i = lines.index(next(l for l in lines if "down_proj.weight' has shape" in l))
    assert lines[i + 1].startswith("    rule `model.layers.{i}.mlp.down_proj.weight` at ") and "llama.ucl:" in lines[i + 1]
    assert lines[i + 2] == ("    ... and 7 more like this ('model.layers.1.mlp.down_proj.weight', "
                            "'model.layers.2.mlp.down_proj.weight', ...)"), out
    assert "model.layers.5.mlp.down_proj" not in out


def test_check_against_strings_are_clean():
    from ucl.formats.hf import check_against
    spec = ucl.load_spec("stdlib:llama")
    params = dict(spec.synthesize_params(LLAMA_DIMS), **{"extra.a": (3,), "extra.b": (4,)})
    problems = check_against(spec, dict(LLAMA_DIMS, ffn=172), params)
    assert problems and not any(p.startswith("error") for p in problems), problems
    assert sum("[UCL203]" in p for p in problems) == 3 and all("rule `" in p for p in problems if "[UCL203]" in p)
    unmatched = [p for p in problems if "[UCL201]" in p]
    assert len(unmatched) == 2 and "extra.a" in unmatched[0] and "hint: add a rule" in unmatched[0]


def test_check_prints_spec_names_and_paths_literally(capsys, tmp_path):
    rc, out, err = main(capsys, "check", "stdlib:llama")
    assert rc == 0, err
    assert out.startswith("ok: stdlib:llama: ") and "\N{LLAMA}" not in out, out
    (tmp_path / ":smile:").mkdir()
    odd = tmp_path / ":smile:" / "[bold]odd.ucl"  # neither markup nor an emoji in what is printed
    odd.write_text(LLAMA_MEGATRON)
    rc, out, err = main(capsys, "check", odd)
    assert rc == 0, err
    assert f"ok: {odd}: " in out, out


def test_reshard_reports_progress_from_worker_processes(files, tmp_path):
    calls = []
    stats = ucl.reshard(files["src"], tmp_path / "dst", "pp=1,dp=2,tp=4", workers=2, progress=calls.append)
    assert len(calls) > 1, calls
    assert sum(calls) == stats.bytes_written and all(n > 0 for n in calls)


def test_reshard_progress_bar_has_a_total(capsys, files, tmp_path, monkeypatch):
    import re
    from rich.progress import Progress
    totals = []
    add_task = Progress.add_task

    def spy(self, description, *a, total=None, **k):
        totals.append(total)
        return add_task(self, description, *a, total=total, **k)

    monkeypatch.setattr(Progress, "add_task", spy)
    rc, out, err = main(capsys, "reshard", files["src"], tmp_path / "dst", "--to", "pp=1,dp=2,tp=4", "--workers", "2")
    assert rc == 0, err
    written = int(re.search(r"([\d,]+) B written", out).group(1).replace(",", ""))
    assert totals == [written], (totals, out)


def test_pytest_config_does_not_hide_the_pass_count():
    import tomllib
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        opts = tomllib.load(f)["tool"]["pytest"]["ini_options"]
    assert "-q" not in str(opts.get("addopts", "")).split()


@pytest.mark.parametrize("preset", [None, "3"])
def test_the_command_line_keeps_openblas_from_spinning_a_thread_per_core(preset):
    """numpy is imported after main() set OPENBLAS_NUM_THREADS=1 (the commands do no linear
    algebra), unless the user chose a value."""
    code = ("import os, sys, ucl.cli\n"
            "try:\n    ucl.cli.main(['--version'])\nexcept SystemExit:\n    pass\n"
            "import numpy\nprint(os.environ.get('OPENBLAS_NUM_THREADS'))")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    env["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    if preset is not None:
        env["OPENBLAS_NUM_THREADS"] = preset
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[-1] == (preset or "1")


def test_the_command_collects_cycles_less_often_and_freezes_the_heap_before_exit(capsys, monkeypatch):
    """``entry`` (the console script) raises the collector's thresholds for the short-lived process
    and freezes the heap once ``main`` returns (no sweep of every object at exit); ``main`` as a
    library call leaves the collector alone."""
    import gc
    from ucl import cli
    before = gc.get_threshold()
    monkeypatch.setattr(sys, "argv", ["ucl", "--version"])
    try:
        with pytest.raises(SystemExit):
            cli.entry()
        assert gc.get_threshold() == cli.CLI_GC_THRESHOLD
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert main(capsys, "--version")[0] == 0 and gc.get_threshold() == before


def test_check_against_takes_a_spec_written_for_the_saved_per_expert_names(capsys, tmp_path):
    """save_pretrained writes MoE experts one by one; a spec naming them so (Megatron numbers its
    local experts the same way) passes, as a spec of the fused in-memory tensors does. The
    location of a problem has its column."""
    import numpy as np
    from safetensors.numpy import save_file
    tensors = {f"model.layers.0.mlp.experts.{e}.{p}.weight": np.zeros(s, np.float32) for e in range(2)
               for p, s in (("gate_proj", (8, 4)), ("up_proj", (8, 4)), ("down_proj", (4, 8)))}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    spec = tmp_path / "per_expert.ucl"
    spec.write_text("dims experts, hidden, ffn\nmesh ep, tp\n"
                    "model.layers.{i}.mlp.experts.{e}.gate_proj.weight [ffn, hidden] : split 0 over tp; "
                    "index e of experts over ep\n"
                    "model.layers.{i}.mlp.experts.{e}.up_proj.weight [ffn, hidden] : split 0 over tp; "
                    "index e of experts over ep\n"
                    "model.layers.{i}.mlp.experts.{e}.down_proj.weight [hidden, ffn] : split 1 over tp; "
                    "index e of experts over ep\n")
    rc, out, err = main(capsys, "check", str(spec), "--dims", "experts=2,hidden=4,ffn=8", "--against",
                        str(tmp_path / "model.safetensors"))
    assert rc == 0 and "matched exactly once" in out, (out, err)
    rc, out, err = main(capsys, "check", str(spec), "--dims", "experts=2,hidden=4,ffn=6", "--against",
                        str(tmp_path / "model.safetensors"))
    assert rc == 1 and f"per_expert.ucl:3:52" in out, out  # the column of the rule's shape


def test_check_warns_about_patterns_that_match_nothing_and_still_passes(capsys, tmp_path):
    spec = ucl.load_spec("stdlib:llama")
    model = _fake_model_folder(tmp_path / "model", spec.synthesize_params(LLAMA_DIMS))
    typo = tmp_path / "typo.ucl"
    typo.write_text(spec.text + "state exp_avg for model.layers.*.mlp.gate.weight : follow\n")
    rc, out, err = main(capsys, "check", typo, "--dims", _dims_text(LLAMA_DIMS), "--against", model)
    assert rc == 0, (out, err)
    line = len(spec.text.splitlines()) + 1
    assert (f"{typo}:{line}:19: warning: `state exp_avg for model.layers.*.mlp.gate.weight` matches no parameter "
            "of the model") in out, out
    assert "did you mean `model.layers.0.mlp.gate_proj.weight`?" in out, out
    assert "ok: every tensor" in out
    rc, out, err = main(capsys, "check", "stdlib:llama", "--dims", _dims_text(LLAMA_DIMS), "--against", model)
    assert rc == 0 and "warning" not in out, out
    rc, out, err = main(capsys, "check", typo, "--dims", _dims_text(LLAMA_DIMS))  # synthesized parameters
    assert rc == 0 and out.count("warning:") == 1, out
