"""Runs vLLM launches in the engine's interpreter (`ENGINE_PYTHON vllm_main.py REQUEST.json OUT_DIR`), one after
another (the interpreter and vLLM's imports paid once), and writes what each observed to OUT_DIR/N: result.json (version, model runner, the ids the target captures, the
spec-decode counters, the generated tokens, a start-up refusal's own text) and aux.rankR.seqS.npy (the
prefill's aux states on each rank). tpsim is not installed there: stdlib, numpy and vLLM only.
tpsim.engine.runner writes the request and reads the files."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

MARK = "tpsim-engine: launch"
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


def counters(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            value = getattr(metric, "value", None)
            out[metric.name] = value if value is not None else list(getattr(metric, "values", []))
    return out


def launch(req: dict):
    from vllm import LLM
    extra = {"attention_backend": req["attention_backend"]} if req.get("attention_backend") else {}
    if req["draft"] is not None:
        extra["speculative_config"] = {"method": req.get("method", "eagle3"), "model": req["draft"], "num_speculative_tokens": req["k"]}
    if req["custom_ops"]:
        extra["compilation_config"] = {"custom_ops": req["custom_ops"]}
    return LLM(model=req["target"], skip_tokenizer_init=True, dtype=req["dtype"], seed=0,
               tensor_parallel_size=req["tp"], enforce_eager=True, max_model_len=req["max_model_len"],
               disable_log_stats=False, max_num_seqs=1, enable_prefix_caching=req["prefix_caching"], **extra)


def generate(llm, req: dict, out: Path) -> list[dict]:
    import numpy as np
    from vllm import SamplingParams
    import vllm_hooks
    rows = []
    for s, (prompt, n) in enumerate(zip(req["prompts"], req["max_tokens"])):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        done = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        for rank, states in enumerate(llm.apply_model(vllm_hooks.take)):
            if states:
                np.save(out / f"aux.rank{rank}.seq{s}.npy", np.stack(states))
        rows.append({"generated": list(done.outputs[0].token_ids)})
    return rows


def observe(req: dict, out: Path) -> None:
    import vllm
    result: dict = {"vllm": vllm.__version__, "refused": None}
    t0 = time.perf_counter()
    try:
        llm = launch(req)
    except Exception as e:  # noqa: BLE001 -- a start-up refusal is an observation; its root cause is in the log
        result["refused"] = f"{type(e).__name__}: {e}"
        (out / "result.json").write_text(json.dumps(result))
        return
    result["load_s"] = time.perf_counter() - t0
    result["runner"] = "v2" if llm.llm_engine.vllm_config.use_v2_model_runner else "v1"
    import functools
    import vllm_hooks
    llm.apply_model(functools.partial(vllm_hooks.hook, ids=req["aux_ids"]))
    result["capture_ids"] = llm.apply_model(vllm_hooks.capture_ids)
    t1 = time.perf_counter()
    try:
        result["sequences"] = generate(llm, req, out)
        result["counters"] = counters(llm)
    except Exception as e:  # noqa: BLE001 -- a failure while serving is an observation too; the next launch goes on
        result.update(failed=f"{type(e).__name__}: {e}", sequences=[], counters={})
    result["generate_s"] = time.perf_counter() - t1
    (out / "result.json").write_text(json.dumps(result))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 -- an engine core that failed may be gone already
        pass


def main(argv: list[str]) -> int:
    launches = json.loads(Path(argv[1]).read_text())["launches"]
    for n, req in enumerate(launches):
        out = Path(argv[2]) / str(n)
        out.mkdir()
        print(f"{MARK} {n}", file=sys.stderr, flush=True)  # the runner splits the shared log here
        observe(req, out)
        gc.collect()
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core from this interpreter
    sys.exit(main(sys.argv))
