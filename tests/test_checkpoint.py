"""Checkpoints: export -> load round trips, per-rank slice reads, block-FP8 dequantization,
layers beyond the config, and every bad checkpoint the issue lists (one line, exit 2,
nothing written). Loading runs on real gloo ranks from real safetensors files."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from strategies import TP_DEGREES, config_dicts
from clirun import assert_one_line_error, run_cli
from tpsim.weights.reader import Checkpoint, expected_tensors, validate
from tpsim.weights.export import export_checkpoint
from tpsim.weights.fp8 import dequantize, quantize
from tpsim.config.loader import config_from_dict, load_config, with_overrides
from tpsim.base.errors import UsageError
from tpsim.testing.jobs import load_job, model_job

ROOT = Path(__file__).resolve().parents[1]
TINY = load_config(ROOT / "configs/tiny.yaml")
FP8_SUFFIXES = ("_proj.weight", "_proj_with_mqa.weight")  # the linear weights DeepSeek-V3 ships in fp8


def export(cfg, d: Path, seed: int = 0, dtype: str = "float32", shard: int = 10**12) -> Path:
    export_checkpoint(cfg, seed, d, dtype, shard)
    return d


def read_all(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """A copy of checkpoint `src` with these tensors in one model.safetensors (and this config)."""
    dst.mkdir(parents=True)
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text()) if config is None else config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# --- round trip ------------------------------------------------------------------------------

@settings(max_examples=12)
@given(tp=st.sampled_from(TP_DEGREES), data=st.data(), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from(["float32", "bfloat16"]), shard_kib=st.sampled_from([4, 64, 10**9]))
def test_export_then_load_is_the_seeded_model(rank_pool, tmp_path_factory, tp, data, seed, dtype, shard_kib):
    """Export at any dtype and shard size, load at any TP: every rank's every parameter is
    bitwise the seeded model's, and no rank reads more elements than its shard holds."""
    cfg = config_from_dict(data.draw(config_dicts(tp), label="config"))
    d = export(cfg, tmp_path_factory.mktemp("export") / "ckpt", seed, dtype, shard_kib * 1024)
    assert (d / "model.safetensors.index.json").exists() == (len(list(d.glob("*.safetensors"))) > 1)
    assert validate(Checkpoint(d), load_config(d)) == []
    out = rank_pool.run(load_job, cfg=cfg.to_dict(), dtype=dtype, checkpoint=str(d), tp=tp,
                        seed=seed)
    rows = [r for r in out.values() if r is not None]
    assert len(rows) == tp
    for r in rows:
        assert r["differ"] == [], f"parameters differ from the seeded model: {r['differ'][:3]}"
        assert r["elements_read"] <= r["local_elements"]


def test_capture_of_an_export_equals_the_seeded_capture(rank_pool, tmp_path):
    """The round trip the issue names: export -> load at TP 1, 2, 4 -> identical captures."""
    cfg = with_overrides(TINY, ["num_hidden_layers=4"])
    d = export(cfg, tmp_path / "ckpt", seed=7, shard=200 * 1024)
    ids = list(range(3, 40, 3))
    for tp in (1, 2, 4):
        kw = dict(cfg=cfg.to_dict(), seed=7, dtype="float32", input_ids=ids, positions=["embed", "out(1)", "final"],
                  tp=tp)
        seeded = rank_pool.run(model_job, **kw)
        loaded = rank_pool.run(model_job, checkpoint=str(d), **kw)
        for rank in range(tp):
            assert torch.equal(seeded[rank]["capture"], loaded[rank]["capture"])
            assert torch.equal(seeded[rank]["logits"], loaded[rank]["logits"])


def test_cli_capture_from_export_matches_seeded(tmp_path):
    d = tmp_path / "ckpt"
    r = run_cli("export", "--override", "num_hidden_layers=3", "--seed", "5", "--out", d,
                "--max-shard-size", "100KB")
    assert r.returncode == 0, r
    assert len(list(d.glob("model-*-of-*.safetensors"))) > 1 and (d / "model.safetensors.index.json").exists()
    seeded, loaded = tmp_path / "seeded.safetensors", tmp_path / "loaded.safetensors"
    r1 = run_cli("capture", "--override", "num_hidden_layers=3", "--seed", "5", "--tp", "2", "--out", seeded)
    r2 = run_cli("capture", "--model", d, "--seed", "5", "--tp", "2", "--out", loaded)
    assert r1.returncode == 0 and r2.returncode == 0, (r1, r2)
    with safe_open(str(seeded), "pt") as a, safe_open(str(loaded), "pt") as b:
        assert torch.equal(a.get_tensor("aux_hidden_states"), b.get_tensor("aux_hidden_states"))
        assert b.metadata()["weights"] == f"checkpoint {d.resolve()}"
        assert len(b.metadata()["checkpoint_fingerprint"]) == 64
    # the checkpoint is an input of the run: a capture (or rank dump) written over its files is refused
    shard = sorted(d.glob("model-*-of-*.safetensors"))[0]
    before = {f.name: f.read_bytes() for f in d.iterdir()}
    r = run_cli("capture", "--model", d, "--tp", "1", "--out", shard, "--force")  # --force: still not an input
    assert_one_line_error(r, ["is a file this run reads", "write the capture somewhere else"])
    for name in ("model.safetensors.index.json", "config.json"):  # not a capture's name in the first place
        r = run_cli("capture", "--model", d, "--tp", "1", "--out", d / name)
        assert_one_line_error(r, ["tpsim writes safetensors here"])
    assert {f.name: f.read_bytes() for f in d.iterdir()} == before
    # more layers than the checkpoint holds is refused from the header, before 10**9 layers' shapes are built
    # (it printed nothing for minutes; a hang guard, not a speed test)
    r = run_cli("check", "--tp", "1", "--model", d, "--override", "num_hidden_layers=1000000000", timeout_s=120)
    assert_one_line_error(r, ["num_hidden_layers=1000000000", "holds 3 layers", "use at most 3"])


# --- FP8 ---------------------------------------------------------------------------------------

def fp8_pair(src: Path, root: Path, block: tuple[int, int]) -> tuple[Path, Path]:
    """From an fp32 checkpoint: an fp8 copy (linear weights quantized in `block` blocks, with
    weight_scale_inv and quantization_config) and the reference, every fp8 weight dequantized
    whole and stored in float32."""
    tensors = read_all(src)
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if name.endswith(FP8_SUFFIXES):
            q, s = quantize(t, block)
            fp8[name], fp8[f"{name}_scale_inv"] = q, s
            deq[name] = dequantize(q, s, block)
        else:
            fp8[name] = deq[name] = t
    config = json.loads((src / "config.json").read_text())
    qcfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return (rewrite(src, root / "fp8", fp8, {**config, "quantization_config": qcfg}),
            rewrite(src, root / "dequantized", deq, config))


@settings(max_examples=8)
@given(tp=st.sampled_from([1, 2, 4]), block=st.sampled_from([(128, 128), (16, 24), (8, 8), (5, 7)]),
       dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**31 - 1))
@example(tp=4, block=(5, 7), dtype="float32", seed=0)  # blocks that straddle every rank's slice edge
def test_fp8_slices_dequantize_like_the_full_tensor(rank_pool, tmp_path_factory, tp, block, dtype, seed):
    cfg = with_overrides(TINY, ["num_hidden_layers=2"])
    root = tmp_path_factory.mktemp("fp8")
    fp8, deq = fp8_pair(export(cfg, root / "src", seed), root, block)
    assert validate(Checkpoint(fp8), load_config(fp8)) == []
    out = rank_pool.run(load_job, cfg=load_config(fp8).to_dict(), dtype=dtype,
                        checkpoint=str(fp8), tp=tp, reference=str(deq))
    for r in (r for r in out.values() if r is not None):
        assert r["differ"] == [], f"fp8 slices differ from the dequantized full tensor: {r['differ'][:3]}"


def test_fp8_roundtrip_error_is_small():
    """quantize/dequantize (the test's own fp8 writer) keeps e4m3's ~2^-4 relative precision."""
    w = torch.randn(300, 200)
    q, s = quantize(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    assert float((dequantize(q, s, (128, 128)) - w).norm() / w.norm()) < 0.05


# --- what a checkpoint holds beyond the config --------------------------------------------------

def test_layers_beyond_num_hidden_layers_are_skipped_with_a_note(tmp_path):
    cfg = with_overrides(TINY, ["num_hidden_layers=3"])
    src = export(cfg, tmp_path / "src")
    tensors = read_all(src)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # a DeepSeek-V3-style MTP layer
    d = rewrite(src, tmp_path / "mtp", tensors)
    assert validate(Checkpoint(d), load_config(d)) == \
        ["skipped 1 tensors of layer 3, beyond num_hidden_layers=3 (an MTP layer, or a truncated run)"]
    notes = validate(Checkpoint(d), with_overrides(load_config(d), ["num_hidden_layers=1"]))
    beyond = sum(k.startswith(("model.layers.1.", "model.layers.2.", "model.layers.3.")) for k in tensors)
    assert notes[0].startswith(f"skipped {beyond} tensors of layers 1-3")
    r = run_cli("check", "--model", d, "--tp", "1,2", "--override", "num_hidden_layers=2", "--convention", "vllm-ids",
                "--layers", "0,1,2")
    assert r.returncode == 0, r
    assert "note: skipped" in r.stdout and "checkpoint" in r.stdout


def test_expected_tensors_match_what_transformers_names(tmp_path):
    """Spot-check the Hub names for both q paths and tied embeddings."""
    names = expected_tensors(TINY)
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert names["model.layers.1.mlp.experts.7.down_proj.weight"] == (64, 32)
    v3 = with_overrides(TINY, ["q_lora_rank=16", "tie_word_embeddings=true", "model_type=deepseek_v3",
                               "topk_method=noaux_tc", "scoring_func=sigmoid"])
    names = expected_tensors(v3)
    assert "model.layers.0.self_attn.q_a_layernorm.weight" in names and "lm_head.weight" not in names
    assert names["model.layers.1.mlp.gate.e_score_correction_bias"] == (8,)


# --- bad checkpoints: one line, exit 2, nothing written -----------------------------------------

def _bad_checkpoints(root: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    cfg = with_overrides(TINY, ["num_hidden_layers=2"])
    good = export(cfg, root / "good")
    tensors = read_all(good)
    config = json.loads((good / "config.json").read_text())
    cases = {}

    def case(name, argv, *expect):
        cases[name] = ([str(a) for a in argv], expect)

    d = root / "no_config"
    shutil.copytree(good, d)
    (d / "config.json").unlink()
    case("no-config-json", ["capture", "--model", d], "has no config.json")
    d = root / "config_only"
    d.mkdir()
    shutil.copy(good / "config.json", d)
    case("no-safetensors", ["capture", "--model", d], "no *.safetensors", "config.json")
    name = "model.layers.1.mlp.gate.weight"
    d = rewrite(good, root / "missing", {k: v for k, v in tensors.items() if k != name})
    case("missing-tensor", ["capture", "--model", d], name, str(d / "model.safetensors"), "is missing")
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    d = rewrite(good, root / "shape", {**tensors, name: tensors[name][:, :-1].contiguous()})
    case("wrong-shape", ["capture", "--model", d], name, "[256, 31]", "[256, 32]")
    d = rewrite(good, root / "mtype", tensors, {**config, "model_type": "mixtral"})
    case("unsupported-model-type", ["capture", "--model", d], "model_type='mixtral'", "deepseek_v2, deepseek_v3",
         "llama, qwen3, qwen3_moe, gpt_oss")
    d = rewrite(good, root / "gptq", tensors, {**config, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    case("unsupported-quantization", ["capture", "--model", d], "quant_method='gptq'", "fp8")
    d = rewrite(good, root / "pertensor", tensors, {**config, "quantization_config": {"quant_method": "fp8"}})
    case("per-tensor-fp8", ["capture", "--model", d], "weight_block_size", "[128, 128]")
    d = root / "truncated"
    shutil.copytree(good, d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 1000])
    case("truncated-file", ["capture", "--model", d], "model.safetensors is truncated")
    d = root / "corrupt"
    shutil.copytree(good, d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + data[24:])
    case("corrupt-header", ["capture", "--model", d], "not a safetensors file")
    for name, (corrupt, words) in HEADER_CORRUPTIONS.items():
        d = root / name
        shutil.copytree(good, d)
        corrupt(d / "model.safetensors")
        case(name, ["capture", "--model", d], "model.safetensors is corrupt", *words)
    d = root / "empty_file"
    shutil.copytree(good, d)
    (d / "model.safetensors").write_bytes(b"")
    case("empty-safetensors", ["capture", "--model", d], "too short for a header")
    d = root / "index"
    shutil.copytree(good, d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "model-2.safetensors"}}))
    case("index-lists-missing-shard", ["capture", "--model", d], "model-2.safetensors", "download every shard")
    name = "model.layers.0.self_attn.o_proj.weight"
    q, _ = quantize(tensors[name], (128, 128))
    qcfg = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    d = rewrite(good, root / "noscale", {**tensors, name: q}, {**config, "quantization_config": qcfg})
    case("fp8-without-scale", ["capture", "--model", d], f"{name}_scale_inv is missing")
    case("tp-does-not-divide", ["capture", "--model", good, "--tp", "3"], "--tp 3 does not divide num_attention_heads=8")
    case("override-unknown-field", ["capture", "--model", good, "--override", "num_layers=2"],
         "--override num_layers", "unknown config field")
    case("override-not-key-value", ["capture", "--override", "num_hidden_layers"], "FIELD=VALUE")
    case("override-bad-value", ["check", "--override", "num_hidden_layers=-2"], "num_hidden_layers", "positive")
    case("export-into-non-empty", ["export", "--out", good], "not empty", "--force")
    case("export-out-is-a-file", ["export", "--out", good / "config.json"], "is a file")
    case("export-bad-shard-size", ["export", "--out", root / "new", "--max-shard-size", "5XB"], "--max-shard-size",
         "5GB")
    case("export-too-big-for-disk", ["export", "--model", "deepseek-v3", "--out", root / "v3"], "needs", "free")
    return cases


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor
    root = tmp_path_factory.mktemp("bad")
    cases = _bad_checkpoints(root)
    out = root / "out"
    out.mkdir()
    with ThreadPoolExecutor(4) as ex:
        futures = {}
        for name, (argv, expect) in cases.items():
            if argv[0] == "capture":
                argv = [*argv, "--out", str(out / f"{name}.safetensors")]
            futures[name] = (ex.submit(run_cli, *argv), expect)
        return root, {name: (f.result(), expect) for name, (f, expect) in futures.items()}


def split_file(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_file(path: Path, header_text: str, data: bytes) -> None:
    head = header_text.encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def _shifted(path: Path, by: int, pad: bytes) -> None:
    """Every tensor but the first `by` bytes later (a gap, or with by < 0 an overlap)."""
    header, data = split_file(path)
    first = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    for k, v in header.items():
        if k not in ("__metadata__", first):
            v["data_offsets"] = [v["data_offsets"][0] + by, v["data_offsets"][1] + by]
    write_file(path, json.dumps(header), data + pad)


def _metadata_list(path: Path) -> None:
    header, data = split_file(path)
    write_file(path, json.dumps({**header, "__metadata__": [1, 2]}), data)


def _duplicate_key(path: Path) -> None:
    header, data = split_file(path)
    name = next(k for k in header if k != "__metadata__")
    text = json.dumps(header)
    write_file(path, text[:-1] + f", {json.dumps(name)}: {json.dumps(header[name])}" + "}", data)


HEADER_CORRUPTIONS = {  # each was exit 3 after the ranks started ("rank N failed ... SafetensorError")
    "header-overlap": (lambda p: _shifted(p, -4, b""), ["overlaps"]),
    "header-gap": (lambda p: _shifted(p, 4, b"\0" * 4), ["4 unclaimed bytes", "contiguous"]),
    "header-trailing-bytes": (lambda p: p.write_bytes(p.read_bytes() + b"\0" * 8), ["8 bytes after the last tensor"]),
    "header-metadata-not-a-map": (_metadata_list, ["__metadata__ is not a map"]),
    "header-duplicate-key": (_duplicate_key, ["twice"]),
}


BAD_NAMES = [*HEADER_CORRUPTIONS, "no-config-json", "no-safetensors", "missing-tensor", "wrong-shape", "unsupported-model-type",
             "unsupported-quantization", "per-tensor-fp8", "truncated-file", "corrupt-header", "empty-safetensors",
             "index-lists-missing-shard", "fp8-without-scale", "tp-does-not-divide", "override-unknown-field",
             "override-not-key-value", "override-bad-value", "export-into-non-empty", "export-out-is-a-file",
             "export-bad-shard-size", "export-too-big-for-disk"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_checkpoint_input(bad_runs, name):
    root, runs = bad_runs
    r, expect = runs[name]
    assert_one_line_error(r, expect)
    assert list((root / "out").iterdir()) == [], "a failed run wrote a file"
    assert not (root / "new").exists() and not (root / "v3").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".")], "an export left a temporary directory"


def test_bad_cases_are_all_listed(bad_runs):
    assert sorted(bad_runs[1]) == sorted(BAD_NAMES)


@pytest.mark.parametrize("name", list(HEADER_CORRUPTIONS))
def test_verify_gives_a_verdict_on_a_corrupt_header(tmp_path, name):
    """`tpsim verify` on a corrupt file said nothing but a traceback; now it is a FAIL line, exit 1."""
    export_checkpoint(with_overrides(TINY, ["num_hidden_layers=1"]), 0, tmp_path / "ck", "bfloat16", 1 << 30)
    shard = tmp_path / "ck" / "model.safetensors"
    corrupt, words = HEADER_CORRUPTIONS[name]
    corrupt(shard)
    r = run_cli("verify", shard)
    assert r.returncode == 1 and f"FAIL {shard}: is corrupt" in r.stdout and "Traceback" not in r.stderr, r
    assert all(w in r.stdout for w in words), r.stdout


def test_checkpoint_api_errors_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="is not a directory"):
        Checkpoint(tmp_path / "nope")
