"""tpsim's EAGLE-3 draft forward against the `speculators` package's `Eagle3DraftModel` (vLLM's draft
format; written outside this project) on the same random float32 weights: step 0 from the capture and
one fed-back step, logits and pre-final-norm hidden states within 1e-5."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("speculators.models.eagle3", reason="speculators is not installed: pip install -e '.[draft-parity]'")
from hypothesis import given, settings, strategies as st  # noqa: E402
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from tpsim.draft.attention import DraftCache  # noqa: E402
from tpsim.draft.config import DraftConfig  # noqa: E402
from tpsim.draft.model import Eagle3Draft  # noqa: E402
from tpsim.draft.weights import load  # noqa: E402

TOL = 1e-5


def reference(cfg: DraftConfig) -> Eagle3DraftModel:
    tl = LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                     head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, num_hidden_layers=1,
                     rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta)
    tl._attn_implementation = "eager"  # dense float masks: flex attention's block masks are a training speed-up
    spec = SpeculatorsConfig(algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig()],
                             default_proposal_method="greedy",
                             verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]))
    return Eagle3DraftModel(Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=cfg.draft_vocab_size, speculators_config=spec,
        norm_before_residual=cfg.norm_before_residual, fc_norm=cfg.fc_norm, norm_before_fc=cfg.norm_before_fc,
        norm_output=cfg.norm_output)).eval()


def randomize(ref: Eagle3DraftModel, seed: int) -> dict[str, torch.Tensor]:
    """Random weights in `ref`: norms away from 1 so a skipped norm shows, matrices scaled by 1/sqrt(fan_in) so
    activations stay O(1) and 1e-5 is an absolute bound near float32's resolution; returned in SpecForge's names."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * noise)
            else:
                p.copy_(noise if name.startswith("embed_tokens") else noise / p.shape[1] ** 0.5)
        if ref.d2t is not None:
            ref.d2t.copy_(torch.randperm(ref.verifier_vocab_size, generator=g)[:ref.draft_vocab_size].sort().values
                          - torch.arange(ref.draft_vocab_size))
    return {k.replace("layers.0.", "midlayer."): v
            for k, v in ref.state_dict().items() if not k.startswith("verifier_")}


def run_reference(ref, capture, tokens, tokens_next, positions):
    """speculators' TTT forward, two steps, rows = T chains; hooks read what it does not return: the hidden
    each step feeds the next (its layer's output, or its final norm's under norm_output) and the logits."""
    seen = {"hidden": [], "normed": [], "logits": []}
    hooks = [ref.layers[0].register_forward_hook(lambda m, a, out: seen["hidden"].append(out)),
             ref.norm.register_forward_hook(lambda m, a, out: seen["normed"].append(out)),
             ref.lm_head.register_forward_hook(lambda m, a, out: seen["logits"].append(out))]
    try:
        with torch.no_grad():
            # its step 1 reads original_input_ids shifted by one: tokens_next
            ids = tokens.clone()
            ids_shifted = torch.cat([tokens[1:], tokens.new_zeros(1)])
            assert torch.equal(ids_shifted[:-1], tokens_next[:-1])
            ref(capture[None], ids[None], torch.zeros(1, len(tokens), dtype=torch.long),
                position_ids=positions[None], ttt_steps=2)
    finally:
        for h in hooks:
            h.remove()
    fed_back = seen["normed"] if ref.config.norm_output else seen["hidden"]
    return [h[0] for h in fed_back], [lg[0] for lg in seen["logits"]]


def compare(cfg: DraftConfig, t: int, seed: int) -> float:
    ref = reference(cfg)
    weights = randomize(ref, seed)
    ours = Eagle3Draft(cfg)
    assert load(ours, weights) == []
    g = torch.Generator().manual_seed(seed + 1)
    capture = torch.randn(t, cfg.capture_width, generator=g)
    tokens = torch.randint(0, cfg.vocab_size, (t,), generator=g)
    tokens_next = torch.cat([tokens[1:], tokens.new_zeros(1)])  # what speculators' TTT feeds step 1
    positions = torch.arange(t)
    ref_h, ref_logits = run_reference(ref, capture, tokens, tokens_next, positions)
    cache = DraftCache()
    with torch.no_grad():
        s0 = ours.first(capture, tokens, positions, cache)
        s1 = ours.next(s0, tokens_next, cache)
    worst = 0.0
    for mine, theirs in ((s0.hidden, ref_h[0]), (s0.logits, ref_logits[0]), (s1.hidden, ref_h[1]),
                         (s1.logits, ref_logits[1])):
        assert mine.shape == theirs.shape
        worst = max(worst, (mine - theirs).abs().max().item())
    assert worst <= TOL, worst
    if ref.d2t is not None:
        assert torch.equal(ours.proposals(s0), s0.logits.argmax(-1) + ref.d2t[s0.logits.argmax(-1)])
    return worst


def test_parity_fixed_shape():
    cfg = DraftConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=64, draft_vocab_size=24, target_hidden_size=32)
    print(f"max |tpsim - speculators| = {compare(cfg, 9, 0):.3g}")


@settings(max_examples=15, deadline=None)
@given(heads=st.sampled_from([(2, 1), (2, 2), (4, 2), (4, 1)]), head_dim=st.sampled_from([4, 8]),
       hidden=st.sampled_from([8, 16, 24]), t=st.integers(1, 7), vocab=st.integers(8, 40),
       variant=st.sampled_from(["plain", "fc_norm", "norm_before_fc", "norm_before_residual", "norm_output"]),
       seed=st.integers(0, 2 ** 16))
def test_parity_drawn(heads, head_dim, hidden, t, vocab, variant, seed):
    draft_vocab = max(2, vocab // 2)
    cfg = DraftConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads[0],
                      num_key_value_heads=heads[1], head_dim=head_dim, vocab_size=vocab, draft_vocab_size=draft_vocab,
                      target_hidden_size=hidden, fc_norm=variant == "fc_norm",
                      norm_before_fc=variant == "norm_before_fc", norm_before_residual=variant == "norm_before_residual",
                      norm_output=variant == "norm_output")
    compare(cfg, t, seed)


@settings(max_examples=5, deadline=None)
@given(variant=st.sampled_from(["plain", "fc_norm", "norm_before_fc", "norm_output"]), seed=st.integers(0, 2 ** 16))
def test_a_draft_speculators_saved_reads_as_the_one_it_saved(tmp_path_factory, variant, seed):
    """speculators' own save_pretrained (config in its format, the layer as layers.0.*) read by tpsim.draft.checkpoint
    gives the draft its config and weights say: the same config, and every tensor where `load` puts it."""
    from tpsim.draft.checkpoint import read
    from tpsim.draft.config import Layout
    cfg = DraftConfig(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                      vocab_size=40, draft_vocab_size=12, target_hidden_size=16, fc_norm=variant == "fc_norm",
                      norm_before_fc=variant == "norm_before_fc", norm_output=variant == "norm_output")
    ref = reference(cfg)
    weights = randomize(ref, seed)
    folder = tmp_path_factory.mktemp("speculators")
    ref.save_pretrained(str(folder))
    got = read(folder)
    assert got.layout is Layout.SPECULATORS and got.config == cfg
    assert set(got.tensors) - {"t2d"} == set(weights) - {"t2d"}
    assert all(torch.equal(got.tensors[k], v) for k, v in weights.items() if k != "t2d")
