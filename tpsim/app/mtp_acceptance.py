"""The cost of an MTP feed-back mismatch in AL (issue 53 deliver 2), on the real small target: an MTP-style
one-layer head trained on the target's final POST-norm hidden (`final`, model.norm's output) is run on the
capture it was trained on and on the PRE-norm block output (`out(L-1)`, what an engine that skips model.norm
hands it), over the target's greedy answers, with tpsim's exact offline acceptance (tpsim.draft.acceptance:
`chains`, `rounds`, `paired`); and with its own output fed back between steps the other way than trained
(`norm_output` flipped: vLLM 0.32.0's glm4_moe_mtp.py feeds the pre-norm one back). One TP-1 forward per sequence
gives both captures (TP does not change them: a `Replicate()` capture is the TP-1 tensor)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from tpsim.app.prompts import Sequence, read_prompts
from tpsim.capture.positions import Position, PositionKind
from tpsim.config.loader import load_config
from tpsim.draft.acceptance import Acceptance, chains, greedy_prefix, paired, rounds
from tpsim.draft.checkpoint import build, read
from tpsim.parallel.group import TPGroup
from tpsim.run.jobs import build_model, run_captured_parts
from tpsim.weights.gguf_builtin import checkpoint_dir

EMBED = "model.embed_tokens.weight"


@dataclass(frozen=True)
class Fed:
    """What the head reads: at step 0 (`final` or `out(L-1)`) and between steps (its own pre- or post-norm
    output)."""

    label: str
    step0: Position
    later_post_norm: bool


@dataclass(frozen=True)
class MtpMeasure:
    trained: Acceptance
    fed: dict[str, Acceptance]  # label -> acceptance with that feed

    def difference(self, label: str) -> tuple[float, float]:
        """Fed `label` minus trained, accepted tokens per round, position by position; its standard error."""
        return paired(self.trained, self.fed[label])

    def to_dict(self) -> dict:
        def al(a: Acceptance) -> dict:
            return {"acceptance_length": round(a.length, 4), "stderr": round(a.stderr, 4), "rounds": a.rounds,
                    "per_position": [round(x, 4) for x in a.per_position]}
        out = {"trained": al(self.trained)}
        for label, a in self.fed.items():
            mean, se = self.difference(label)
            out[label] = {**al(a), "paired_difference": round(mean, 4), "paired_stderr": round(se, 4),
                          "below_2se": mean < -2 * se}
        return out


def feeds(layers: int, later_post_norm: bool) -> tuple[Fed, ...]:
    """The trained feed first (step 0 `final`, later steps as the head's `norm_output` says), then each mismatch."""
    final, pre = Position(PositionKind.FINAL), Position(PositionKind.OUT, layers - 1)
    flipped = "later-pre-norm" if later_post_norm else "later-post-norm"
    return (Fed("trained", final, later_post_norm), Fed("step0-pre-norm", pre, later_post_norm),
            Fed(flipped, final, not later_post_norm))


def measure(head: Path, prompts: Path, k: int = 3, model: str = "smollm2-135m", limit: int | None = None) -> MtpMeasure:
    target_dir = checkpoint_dir(model)
    cfg = load_config(target_dir)
    target = build_model(cfg, TPGroup(), 0, "float32", str(target_dir))
    ckpt = read(head)
    from safetensors import safe_open
    with safe_open(str(target_dir / "model.safetensors"), "pt") as f:
        embed = f.get_tensor(EMBED)
    heads = {on: build(dataclasses.replace(ckpt, config=dataclasses.replace(ckpt.config, norm_output=on)), embed).eval()
             for on in (False, True)}
    plan = feeds(cfg.num_hidden_layers, ckpt.config.norm_output)
    seqs = list(read_prompts(prompts, 0).sequences)[:limit]
    got: dict[str, Acceptance] = {f.label: Acceptance(k, ()) for f in plan}
    positions = list(dict.fromkeys(f.step0 for f in plan))
    with torch.no_grad():
        for s in seqs:
            parts, logits = run_captured_parts(target, list(s.tokens), positions)
            n = greedy_prefix(list(s.tokens), logits.argmax(-1).tolist(), s.prompt)
            kept = Sequence(s.tokens[:n], s.prompt)
            if kept.answer <= k:
                continue
            toks = torch.tensor(kept.tokens)
            for f in plan:
                cap = parts[positions.index(f.step0)][:n].float()
                proposed = chains(heads[f.later_post_norm], cap, toks, k)
                got[f.label] = got[f.label] + rounds(proposed, list(kept.tokens), kept.prompt)
    trained = got.pop("trained")
    return MtpMeasure(trained, got)
