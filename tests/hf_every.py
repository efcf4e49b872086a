"""Every decoder causal-LM type of the installed transformers, as a tiny seeded model saved with
``save_pretrained``, and what ucl does with each folder (issue #29's sweep).

    python tests/hf_every.py --table [TYPE ...]   # the per-family table (markdown) on stdout

API (used by tests/test_hf_every.py)::

    decoder_types()          # [(model_type, None | reason it is skipped)], every causal-LM type
    tiny_config(model_type)  # a small PretrainedConfig (class defaults, sizes shrunk)
    build(model_type)        # the real transformers model, seeded, float32, eval()
    saved(model_type)        # (folder, model): the save_pretrained folder, cached on disk
    check(model_type, work)  # a Row: spec source, in place, round trip, export, tp share, reason

Models are built with ``torch.manual_seed(0)``; folders are cached under ``$UCL_HF_EVERY_CACHE``
(default ``~/.cache/ucl-tests/hf_every``), keyed by the transformers version, so reruns are fast.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import traceback
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

SEEDING = "by-name"  # in the folder cache's key: a change of how values are drawn is another folder
MOE_LAYERS = 3  # a MoE model gets a dense first layer where its config can say so
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _version() -> str:
    import transformers
    return transformers.__version__


def cache_dir() -> Path:
    root = os.environ.get("UCL_HF_EVERY_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ucl-tests",
                                                                 "hf_every")
    return Path(root) / _version()


def decoder_types() -> list[tuple[str, str | None]]:
    """Every causal-LM model type of the installed transformers, with the reason it is skipped (None:
    a decoder-only language model, swept); the list and the reasons are tests/hf_zoo.py's."""
    import hf_zoo
    swept = hf_zoo.zoo_types()
    return sorted([(t, None) for t in swept] + list(hf_zoo.SKIPPED.items()))


def tiny_config(model_type: str):
    """hf_zoo's tiny config (size 0), with MoE models given a dense first layer where the config can
    say so (``first_k_dense_replace``, ``mlp_only_layers``), and sizes the model's forward accepts:
    MLA without GQA and with rope's head_dim the rotary part, a rotary_dim within a head (codegen,
    gptj), DBRX's qkv clipping set (its forward clamps with both bounds None otherwise)."""
    import hf_zoo
    config = hf_zoo.tiny_config(model_type)
    fields = config.to_dict()
    changed = {}
    hybrid = any(isinstance(v, list) and k.endswith(("layer_types", "block_type")) for k, v in fields.items())
    if any(fields.get(k) for k in _EXPERTS) and not hybrid:
        if isinstance(fields.get("first_k_dense_replace"), int):
            changed.update(first_k_dense_replace=1, num_hidden_layers=MOE_LAYERS)
        elif "mlp_only_layers" in fields:
            changed.update(mlp_only_layers=[0], num_hidden_layers=MOE_LAYERS)
    if any(fields.get(k) for k in _EXPERTS) and isinstance(fields.get("n_group"), int):
        changed.update(n_group=2, topk_group=1)  # expert groups that divide the tiny expert count
    if fields.get("kv_lora_rank") is not None and "num_key_value_heads" in fields:
        changed["num_key_value_heads"] = fields.get("num_attention_heads")
    if fields.get("kv_lora_rank") is not None and fields.get("qk_rope_head_dim") is not None and "head_dim" in fields:
        changed["head_dim"] = fields["qk_rope_head_dim"]  # MLA: the rotary part is the head_dim rope sees
    heads = fields.get("n_head") or fields.get("num_attention_heads")
    width = fields.get("n_embd") or fields.get("hidden_size")
    if isinstance(fields.get("rotary_dim"), int) and heads and width and fields["rotary_dim"] > width // heads:
        changed["rotary_dim"] = width // heads // 2
    if isinstance(fields.get("attn_config"), dict) and "clip_qkv" in fields["attn_config"] \
            and fields["attn_config"]["clip_qkv"] is None:
        changed["attn_config"] = {**fields["attn_config"], "clip_qkv": 8.0}
    if not changed:
        return config
    fields.update(changed)
    for k in ("architectures", "transformers_version", "model_type", "dtype", "torch_dtype"):
        fields.pop(k, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return type(config)(**fields)
        except Exception:  # noqa: BLE001 - the class refuses the change: hf_zoo's config as it is
            return config


def build(model_type: str):
    from transformers import AutoModelForCausalLM
    config = tiny_config(model_type)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # seeded by name: no zero-init tensor, nor two of one shape, hides a swapped copy
        for name, p in model.named_parameters():  # (buffers keep their values: non-persistent ones are not saved)
            if p.is_floating_point():
                seed = zlib.crc32(name.encode())
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05
                        + torch.arange(p.numel()).reshape(p.shape) * 1e-6)
    if hasattr(model, "tie_weights"):  # as from_pretrained will: a tied head takes the embedding's values
        model.tie_weights()
    return model.eval()


def saved(model_type: str) -> tuple[Path, object]:
    """The save_pretrained folder of the tiny model (cached) and the model itself."""
    model = build(model_type)
    digest = hashlib.sha256((SEEDING + model.config.to_json_string()).encode()).hexdigest()[:12]
    folder = cache_dir() / f"{model_type}-{digest}"  # a changed tiny config is another folder
    if not (folder / "config.json").is_file():
        tmp = Path(tempfile.mkdtemp(dir=cache_dir().parent if cache_dir().parent.exists() else None))
        cache_dir().mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(tmp / "m")
        os.replace(tmp / "m", folder) if not folder.exists() else None
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, model


@dataclass
class Row:
    model_type: str
    spec_source: str = "-"
    in_place: str = "-"
    round_trip: str = "-"
    export: str = "-"
    tp_share: float | None = None
    reason: str = ""

    def cells(self) -> list[str]:
        share = "-" if self.tp_share is None else f"{self.tp_share:.2f}"
        return [self.model_type, self.spec_source, self.in_place, self.round_trip, self.export, share, self.reason]


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:220]}"


def _reference(model) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def check(model_type: str, work: Path, export: bool = True) -> Row:
    """Read the saved folder in place, reshard to pp=2,dp=2,tp=2 (ep=2 with experts) and back, compare
    with the model's state dict bit for bit; export to HF, reload, compare logits; the TP share."""
    import ucl
    from ucl.formats import registry
    row = Row(model_type)
    try:
        folder, model = saved(model_type)
    except Exception as e:  # noqa: BLE001 - a model transformers cannot build is a skip, named
        row.reason = "cannot build: " + _short(e)
        return row
    try:
        registry.forget()
        desc = registry.describe(str(folder))
        row.spec_source = desc.state.get("hf", {}).get("spec_source", desc.spec_name or "?")
        row.in_place = "ok"
    except Exception as e:  # noqa: BLE001
        row.in_place, row.reason = "FAIL", _short(e)
        return row
    ref = _reference(model)
    try:
        axes = list(ucl.load_spec(desc.spec).axes)
        mesh = ",".join(f"{a}=2" for a in axes)
        a, b = work / f"{model_type}-a", work / f"{model_type}-b"
        ucl.reshard(str(folder), str(a), to=mesh, workers=1, durable=False)
        ucl.reshard(str(a), str(b), to="universal", workers=1, durable=False)
        got = ucl.load_rank(str(b), mesh="universal", rank=0, as_torch=True)
        names = {k.split("/", 1)[1] for k in got}
        tied_dupes = {n for n in ref if n not in names and _tied_alias(model, n)}
        missing = sorted(set(ref) - names - tied_dupes)
        extra = sorted(names - set(ref))
        bad = [n for n in names & set(ref) if not _same(got[f"param/{n}"], ref[n])]
        if missing or extra or bad:
            row.round_trip = "FAIL"
            row.reason = f"missing {missing[:3]} extra {extra[:3]} differ {bad[:3]}"
        else:
            row.round_trip = "ok"
        row.tp_share = _tp_share(folder)
    except Exception as e:  # noqa: BLE001
        row.round_trip, row.reason = "FAIL", _short(e)
        return row
    if export:
        try:
            from ucl.ops.export import export_hf
            out = work / f"{model_type}-hf"
            export_hf(str(a), str(out))
            row.export = "ok" if _same_logits(model, out) else "FAIL"
            if row.export == "FAIL":
                row.reason = "logits differ after export"
        except Exception as e:  # noqa: BLE001
            row.export, row.reason = "FAIL", _short(e)
    shutil.rmtree(work, ignore_errors=True)
    return row


def _tied_alias(model, name: str) -> bool:
    sd = model.state_dict()
    t = sd[name]
    return any(o is not t and o.data_ptr() == t.data_ptr() for k, o in sd.items() if k != name) \
        or name not in dict(model.named_parameters(remove_duplicate=True)) and name in dict(
            model.named_parameters(remove_duplicate=False))


def _same(a, b) -> bool:
    a = torch.as_tensor(a)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1
                                                                       else a, b)


def _tp_share(folder: Path) -> float:
    import ucl
    total = sum(int(np.asarray(v).nbytes) for v in ucl.load_rank(str(folder), mesh="universal", rank=0).values())
    per = [sum(int(np.asarray(v).nbytes) for v in ucl.load_rank(str(folder), mesh="tp=2", rank=r).values())
           for r in range(2)]
    return max(per) / max(1, total)


def _same_logits(model, out: Path) -> bool:
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():  # fresh aligned memory: kernels on a tensor mmapped at an unaligned file offset
        for p in back.parameters():  # may round differently (1 ulp in qwen3_5_moe_text's grouped_mm)
            p.data = p.data.clone()
    ids = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 23]])
    with torch.no_grad():
        x, y = model(input_ids=ids, use_cache=False).logits, back(input_ids=ids, use_cache=False).logits
    return torch.equal(x, y)


def table(types: list[str] | None = None, export: bool = True) -> list[Row]:
    rows = []
    for t, skip in decoder_types():
        if types and t not in types:
            continue
        if skip:
            continue
        work = Path(tempfile.mkdtemp(prefix=f"hf-every-{t}-"))
        try:
            row = check(t, work, export)
        except Exception as e:  # noqa: BLE001 - the table names every failure, never stops
            row = Row(t, reason="harness: " + _short(e))
            traceback.print_exc()
        finally:
            shutil.rmtree(work, ignore_errors=True)
        rows.append(row)
        print("| " + " | ".join(row.cells()) + " |", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("types", nargs="*")
    p.add_argument("--table", action="store_true")
    p.add_argument("--no-export", action="store_true")
    a = p.parse_args(argv)
    print("| type | spec source | in place | round trip | export | tp share | reason |")
    print("|---|---|---|---|---|---|---|")
    rows = table(a.types or None, export=not a.no_export)
    ok = sum(r.in_place == r.round_trip == "ok" and r.export in ("ok", "-") for r in rows)
    print(f"\n{ok} of {len(rows)} ok; skipped: " + ", ".join(t for t, s in decoder_types() if s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
