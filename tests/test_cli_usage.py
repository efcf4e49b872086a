"""The command line as a new user meets it: a Checkpointer root opens its latest, `inspect` piped is
greppable, an export option of another format is a usage error, `export hf|dcp` without torch says
what to install, every option has help and the README's synopsis lists every option."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ucl
import ucl.cli
from ucl.cli.parser import build_parser

from test_cli import main  # noqa: E402  (one in-process runner for both CLI test modules)

REPO = Path(__file__).resolve().parent.parent
SPEC = "dims vocab, hidden\nmesh tp\nembedding.weight_of_a_rather_long_parameter_name [vocab, hidden] : split 0 over tp\n" \
       "norm.weight [hidden] : replicate over tp\n"
# blocks `import torch` (as on a machine without it) and runs the command line
NO_TORCH = ("import sys, runpy\n"
            "class NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'torch':\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            "sys.argv = ['ucl'] + sys.argv[1:]\n"
            "runpy.run_module('ucl.cli', run_name='__main__')\n")


def run(*args, prelude: str | None = None, columns: int = 200):
    """`ucl ARGS` in a fresh interpreter, stdout a pipe: (exit code, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS=str(columns))
    cmd = [sys.executable, "-c", prelude, *map(str, args)] if prelude else [sys.executable, "-m", "ucl.cli", *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    return p.returncode, p.stdout, p.stderr


call = main  # `ucl ARGS` in-process: (exit code, stdout, stderr)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A small tp=2 checkpoint with a long parameter name."""
    spec = ucl.load_spec(SPEC)
    dims = {"vocab": 8, "hidden": 4}
    model = spec.bind(dims, spec.synthesize_params(dims))
    rng = np.random.default_rng(0)
    full = {t.key: rng.standard_normal(t.shape).astype(np.float32) for t in model.tensors}
    shards = ucl.execute_memory(ucl.compile(model, "universal", "tp=2"), {0: full})
    path = tmp_path_factory.mktemp("usage") / "ckpt"
    ucl.save(path, shards, model=model, mesh="tp=2")
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A Checkpointer root: steps 0 and 1, latest -> step 1."""
    torch = pytest.importorskip("torch")
    path = tmp_path_factory.mktemp("root") / "run"
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ucl.Checkpointer(path, model, opt) as ck:
        for step in range(2):
            opt.step()
            ck.save(step)
    return path


# ---------------------------------------------------------------- a checkpoint root opens its latest

@pytest.mark.parametrize("cmd", [["inspect"], ["verify"]])
def test_inspect_and_verify_open_a_roots_latest_and_say_so(capsys, root, cmd):
    rc, out, err = call(capsys, *cmd, root)
    assert rc == 0, (out, err)
    assert f"{root} is a checkpoint root; opening its latest, step_00000001" in err, err
    assert str(root / "step_00000001") in out, out


def test_reshard_and_export_read_a_roots_latest(capsys, root, tmp_path):
    rc, out, err = call(capsys, "reshard", root, tmp_path / "flat", "--to", "universal", "--quiet")
    assert rc == 0 and "step_00000001" in err, (out, err)
    rc, out, err = call(capsys, "export", "deepspeed-universal", root, tmp_path / "ds")
    assert rc == 0 and "step_00000001" in err, (out, err)
    with ucl.open(tmp_path / "flat") as flat, ucl.open(root) as latest:  # the Python API follows it too
        assert latest.path.endswith("step_00000001")
        assert flat.manifest.state == latest.manifest.state


def test_a_root_whose_latest_names_a_missing_step_is_a_clear_error(tmp_path):
    (tmp_path / "latest").write_text("step_00000009\n")
    rc, out, err = run("inspect", tmp_path)
    assert rc == 1 and "Traceback" not in err and "step_00000009, which is not a committed checkpoint" in err, err


# ---------------------------------------------------------------- inspect, piped

def test_inspect_piped_is_one_unwrapped_line_per_parameter(ckpt):
    rc, out, err = run("inspect", ckpt, columns=40)  # a narrow terminal width must not matter in a pipe
    assert rc == 0, err
    lines = out.splitlines()
    name = "embedding.weight_of_a_rather_long_parameter_name"
    found = [line for line in lines if name in line]  # what `| grep NAME` prints
    assert len(found) == 1 and found[0].startswith(name) and "[8, 4]" in found[0] and "split 0 over tp" in found[0]
    assert [line for line in lines if line.startswith("norm.weight")] != []
    assert out.count("param (float32)") == 1, out  # kinds once, not per parameter
    assert "│" not in out and "┃" not in out, out  # no table


def test_inspect_on_a_terminal_is_a_table_with_whole_names(ckpt, capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setenv("FORCE_COLOR", "0")
    rc, out, err = call(capsys, "inspect", ckpt)
    assert rc == 0, err
    assert "embedding.weight_of_a_rather_long_parameter_name" in out and "layout rule" in out, out


# ---------------------------------------------------------------- export options of other formats

@pytest.mark.parametrize("fmt, flag", [("dcp", ["--dtype", "bfloat16"]), ("dcp", ["--max-shard-size", "1GB"]),
                                       ("dcp", ["--tag", "t"]), ("dcp", ["--config", "c.json"]),
                                       ("dcp", ["--no-fsync"]), ("hf", ["--style", "torchtitan"]),
                                       ("hf", ["--tag", "t"]), ("deepspeed-universal", ["--dtype", "bfloat16"]),
                                       ("deepspeed-universal", ["--style", "state_dict"])],
                         ids=lambda x: x if isinstance(x, str) else x[0])
def test_an_export_option_of_another_format_is_a_usage_error(capsys, ckpt, tmp_path, fmt, flag):
    rc, out, err = call(capsys, "export", fmt, ckpt, tmp_path / "out", *flag)
    assert rc == 2, (rc, out, err)
    assert "usage: ucl export" in err and f"{flag[0]} applies to export" in err and f"not {fmt}" in err, err
    assert not (tmp_path / "out").exists()


def test_export_help_says_dtype_reads_the_fp32_master(capsys):
    rc, out, _ = call(capsys, "export", "--help")
    options = out[out.index("options:"):]
    assert rc == 0 and "fp32 master" in " ".join(options[options.index("--dtype"):].split()[:30]), out


# ---------------------------------------------------------------- export without torch

@pytest.mark.parametrize("fmt", ["hf", "dcp"])
def test_export_without_torch_is_one_line_naming_the_extra(ckpt, tmp_path, fmt):
    rc, out, err = run("export", fmt, ckpt, tmp_path / "out", prelude=NO_TORCH)
    assert rc == 1, (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"ucl: ucl export {fmt} needs torch: pip install 'ucl[torch]'"), err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- help and the README synopsis

def _subparsers(parser):
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its subcommands here
        if action.choices and hasattr(action, "_name_parser_map"):
            yield from action.choices.items()


def _options(parser) -> list:
    return [a for a in parser._actions if a.option_strings and "--help" not in a.option_strings]  # noqa: SLF001


def test_every_option_of_every_subcommand_has_help():
    missing = []
    for name, sub in _subparsers(build_parser()):
        subs = list(_subparsers(sub)) or [(None, sub)]
        for subname, p in subs:
            missing += [f"{name} {subname or ''} {a.option_strings[-1]}" for a in _options(p) if not a.help]
    assert not missing, missing


def test_the_readme_synopsis_lists_every_option_of_every_subcommand():
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Command line\n\n```sh\n(.*?)```", text, re.S).group(1)
    listed: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        code = line.split("#", 1)[0]
        m = re.match(r"ucl (\w[\w-]*)", code)
        if m:
            current = m.group(1)
        elif not line.startswith(" "):
            current = None  # python -m ucl ..., torchrun ...
        if current and code.strip():
            listed[current] = listed.get(current, "") + " " + code
    missing = []
    for name, sub in _subparsers(build_parser()):
        assert name in listed, f"README synopsis lacks `ucl {name}`"
        words = set(re.findall(r"-{1,2}[\w-]+", listed[name]))
        for _, p in list(_subparsers(sub)) or [(None, sub)]:
            missing += [f"ucl {name} {a.option_strings[-1]}" for a in _options(p)
                        if not set(a.option_strings) & words]
    assert not missing, f"README synopsis lacks: {missing}"
