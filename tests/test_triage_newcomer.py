"""Issue 52's done-when, a held-out newcomer case (a draft and a serving story the issue does not name): a Qwen3-8B
draft, trained by SpecForge on out(1), out(17), out(32), whose config carries a top-level copy of the ids shifted for
vLLM, served by SGLang 0.5.12 at TP 4 on an H200 with --enable-flashinfer-allreduce-fusion. One triage command
reaches a PLAN; the user applies it as printed (the engine version, the config fragment, the flags it names) and
triage on the result says "nothing found", exit 0; the same story as a one-line --summary names the PLAN too."""

from __future__ import annotations

import json
import re

from clirun import run_cli
from test_triage_fixes import merged

CONFIG = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
          "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 1,
          "vocab_size": 151936, "draft_vocab_size": 32000, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
          "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]},
          "eagle_aux_hidden_state_layer_ids": [2, 18, 33]}
STORY = ["--server", "sglang@0.5.12", "--tp", "4", "--model", "qwen3-8b", "--enable-flashinfer-allreduce-fusion"]


def test_the_newcomer_reaches_a_plan_that_applied_says_nothing_found(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    first = run_cli("triage", "--draft-config", str(tmp_path / "config.json"), *STORY, "--json")
    report = json.loads(first.stdout)
    assert first.returncode == 1 and report["findings"], first
    plan = report["plan"]
    assert plan is not None and plan["clears"], report
    change, argv = plan["change"], list(STORY)
    if change["server"]:
        argv[argv.index("--server") + 1] = change["server"]
    m = re.search(r"write (.+?) in the draft config", plan["text"])
    fixed = merged(CONFIG, json.loads("{" + m.group(1) + "}")) if m else CONFIG
    (tmp_path / "fixed").mkdir()
    (tmp_path / "fixed" / "config.json").write_text(json.dumps(fixed))
    argv += ["--disable-radix-cache"] if change["radix_off"] else []
    after = run_cli("triage", "--draft-config", str(tmp_path / "fixed" / "config.json"), *argv)
    assert after.returncode == 0 and "\nVERDICT: nothing found\n" in after.stdout, (plan, after.stdout)
    short = run_cli("triage", "--draft-config", str(tmp_path / "config.json"), *STORY, "--summary")
    assert short.returncode == 1 and f"; PLAN: {plan['text']}; plan replayed as a whole: nothing found" in short.stdout
