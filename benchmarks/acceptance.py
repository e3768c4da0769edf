"""The seed's story, measured (issue 36 item 6): the acceptance length a wrong capture costs on a real target,
SmolLM2-135M-Instruct with the draft tpsim trained for it (`smollm2-135m-eagle3`, SpecForge's recipe on
`specforge-ids:1,14,26` = out(1), out(14), out(26)), its 12 held-out prompts, k = 3. Each case is the draft's
config as a user would serve it (ids edited, at another key) and the engine's flags; every case runs
`tpsim acceptance --json` in a fresh process, so the wall time is the command's.

    .venv/bin/python benchmarks/acceptance.py [--out benchmarks/results/acceptance-cpu.json]

`--speed` (on a GPU): the acceptance loop's speed on a full-size seeded target, Llama-3.1-8B shapes in bf16 on
one GPU with a seeded draft of SpecForge's llama3-8B-eagle3 shapes (H 4096, 32/8 heads, I 14336, Vd 32000):
speed only (a random draft accepts nothing).

    PYTHONPATH=. python3 benchmarks/acceptance.py --speed --out benchmarks/results/acceptance-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
DRAFT = ROOT / "configs" / "drafts" / "smollm2-135m-eagle3"


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    argv: tuple[str, ...]
    edit: dict = field(default_factory=dict)  # config.json keys replaced (None: removed)
    random_embed: bool = False  # an exporter's random embed_tokens.weight written into the draft


TRAIN = ("--train", "specforge-ids:1,14,26")
CASES = [
    Case("as trained", "the config as trained, SGLang 0.5.12, TP 1", ("--server", "sglang@0.5.12")),
    Case("TP 3", "the same at TP 3, plain TP (the capture all-reduced: the whole stream)",
         ("--server", "sglang@0.5.12", "--tp", "3")),
    Case("embedding slot", "ids edited to [-1, 14, 26]: slot 0 takes the embedding output, which training never "
                           "captured (SGLang 0.5.12 patched so that -1 runs: +embed)",
         ("--server", "sglang@0.5.12+embed"), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 14, 26]}}),
    Case("off by one", "ids edited to [2, 15, 27] (\"SGLang numbers from the input\"): every slot one layer late",
         ("--server", "sglang@0.5.12"), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}),
    Case("key fallback", "ids moved to a key SGLang does not read (top-level target_layer_ids): its default "
                         "[2, 15, 27] in its numbering, which captures what the trained ids do",
         ("--server", "sglang@0.5.12"), {"eagle_config": None, "target_layer_ids": [1, 14, 26]}),
    Case("Partial(sum)", "TP 3 with --enable-flashinfer-allreduce-fusion on SGLang 0.5.12: the capture is each "
                         "rank's partial sum (rank 0's feeds its draft)",
         ("--server", "sglang@0.5.12", "--tp", "3", "--enable-flashinfer-allreduce-fusion")),
    Case("Partial(sum) fixed", "the same flags on SGLang 0.5.23, whose capture is taken after the fused all-reduce",
         ("--server", "sglang@0.5.23", "--tp", "3", "--enable-flashinfer-allreduce-fusion")),
    Case("random embed_tokens, vLLM", "an export with a random embed_tokens.weight (TorchSpec #38) on vLLM 0.25.0, "
                                      "which keeps a draft's own distinct embedding (PR #28549)",
         ("--server", "vllm@0.25.0"), random_embed=True),
    Case("random embed_tokens, SGLang", "the same draft on SGLang 0.5.12, which always gives the draft the target's",
         ("--server", "sglang@0.5.12"), random_embed=True),
    Case("radix cache by tokens", "the prompts served in order on SGLang 0.5.2, whose radix cache is keyed by "
                                  "tokens: each after the first reuses the draft's KV at position 23 of the shared "
                                  "24-token system prompt, computed with the previous request's token 24 (PR #10846)",
         ("--server", "sglang@0.5.2")),
]


def draft_for(case: Case, tmp: Path) -> Path:
    if not case.edit and not case.random_embed:
        return DRAFT
    out = tmp / "".join(c if c.isalnum() else "-" for c in case.name)
    out.mkdir()
    for f in DRAFT.glob("*.safetensors"):
        if case.random_embed:
            import torch
            from safetensors.torch import load_file, save_file
            tensors = load_file(str(f))
            g = torch.Generator().manual_seed(0)
            tensors["embed_tokens.weight"] = (torch.randn(49152, 576, generator=g) * 0.05).half()
            save_file(tensors, str(out / f.name))
        else:
            os.symlink(f, out / f.name)
    raw = json.loads((DRAFT / "config.json").read_text())
    for key, value in case.edit.items():
        raw.pop(key, None) if value is None else raw.__setitem__(key, value)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def run(case: Case, tmp: Path) -> dict:
    tpsim = str(Path(sys.executable).with_name("tpsim"))
    argv = [tpsim, "acceptance", "--model", "smollm2-135m", "--draft", str(draft_for(case, tmp)), *TRAIN, *case.argv,
            "--json"]
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    took = time.perf_counter() - t0
    if r.returncode not in (0, 1):
        raise SystemExit(f"{case.name}: exit {r.returncode}: {r.stderr.strip()[-400:]}")
    out = json.loads(r.stdout)
    return {"case": case.name, "what": case.what, "argv": ["tpsim", *argv[1:-1]], "exit": r.returncode,
            "seconds": round(took, 1), "answer_tokens_per_s": round(out["answer_tokens"] / took, 1), **out}


LLAMA8B_DRAFT = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                 "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
                 "vocab_size": 128256, "draft_vocab_size": 32000}  # SpecForge configs/llama3-8B-eagle3.json's shapes


def speed(out: Path, repeats: int) -> int:
    import torch
    from safetensors.torch import save_file
    from tpsim.draft.config import DraftConfig
    from tpsim.draft.model import Eagle3Draft
    from tpsim.draft.weights import specs
    with tempfile.TemporaryDirectory() as tmp:
        draft = Path(tmp) / "draft"
        draft.mkdir()
        g = torch.Generator().manual_seed(0)
        cfg = DraftConfig.from_json(LLAMA8B_DRAFT)
        shapes = {n: s.shape for n, s in specs(Eagle3Draft(cfg, _meta())).items() if not n.startswith("embed")}
        tensors = {n: (torch.randn(s, generator=g) / s[-1] ** 0.5 if len(s) > 1 else torch.ones(s)).bfloat16()
                   for n, s in shapes.items()}
        used = torch.randperm(128256, generator=g)[:32000].sort().values
        tensors["d2t"] = used - torch.arange(32000)
        save_file(tensors, str(draft / "model.safetensors"))
        (draft / "config.json").write_text(json.dumps(LLAMA8B_DRAFT))
        argv = [sys.executable, "-m", "tpsim", "acceptance", "--device", "cuda", "--model", "llama-3.1-8b", "--draft",
                str(draft), "--server", "sglang@0.5.12", "--new-tokens", "64", "--json"]
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
            took = time.perf_counter() - t0
            if r.returncode not in (0, 1):
                raise SystemExit(f"exit {r.returncode}: {r.stderr.strip()[-600:]}")
            res = json.loads(r.stdout)
            runs.append({"seconds": round(took, 2), "answer_tokens": res["answer_tokens"],
                         "sequences": res["sequences"], "rounds": res["trained"]["rounds"]})
    med = sorted(x["seconds"] for x in runs)[len(runs) // 2]
    import torch
    doc = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "what": "tpsim acceptance --device cuda --model llama-3.1-8b (seeded, bf16) with a seeded draft of "
                   "llama3-8B-eagle3 shapes: 8 seeded prompts of 16 tokens answered greedily (64 tokens, a full "
                   "forward per token, no KV cache), then the trained and the served capture's forwards and the "
                   "draft's chains; the whole command, process start and weight seeding included",
           "argv": ["tpsim", *argv[3:]], "runs": runs, "median_seconds": med,
           "answer_tokens_per_s_median": round(runs[0]["answer_tokens"] / med, 1)}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return 0


def _meta():
    import torch
    from tpsim.parallel.group import TPGroup
    return TPGroup(device=torch.device("meta"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "acceptance-cpu.json"))
    ap.add_argument("--speed", action="store_true", help="the full-size seeded target on a GPU: speed only")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.speed:
        return speed(Path(args.out), args.repeats)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            results.append(run(case, Path(tmp)))
            print(f"{case.name}: {results[-1]['trained']['acceptance_length']} -> "
                  f"{results[-1]['served']['acceptance_length']} ({results[-1]['seconds']} s)", file=sys.stderr)
    table = Table(title="AL trained vs served: smollm2-135m + smollm2-135m-eagle3, 12 prompts, k = 3")
    for col in ("case", "served capture", "AL trained", "AL served", "paired difference (SE)", "per position served",
                "exit", "s"):
        table.add_column(col)
    for r in results:
        t, s = r["trained"], r["served"]
        table.add_row(r["case"], s["failure"] or ", ".join(s["positions"]) + f" TP {s['tp']} {s['mode']}",
                      f"{t['acceptance_length']:.2f}",
                      "-" if s["acceptance_length"] is None else f"{s['acceptance_length']:.2f}",
                      "-" if r["paired"] is None else f"{r['paired']['difference']:+.3f} ({r['paired']['stderr']:.3f})",
                      "-" if s["per_position"] is None else " ".join(f"{x:.2f}" for x in s["per_position"]),
                      str(r["exit"]), f"{r['seconds']}")
    Console(width=200).print(table)
    Path(args.out).write_text(json.dumps({
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.machine(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "cases": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
