"""Train an MTP-style one-layer head for `--model smollm2-135m` on the target's final POST-norm hidden state
(issue 53 deliver 2): the built-in draft's data, captures and recipe (benchmarks/train_smollm2_draft.py: the
target's greedy answers, tpsim's TP-1 forward, SpecForge's TTT loss, the same draft vocab rule), with one
captured state instead of three: `final` (the output of model.norm), what DeepSeek-V3's MTP module and the
NextN heads were trained on at step 0 (docs/mtp.md). The head is tpsim's one-layer draft with
num_aux_hidden_states 1: step 0 projects the target's hidden at t and reads the embedding of token t+1; later
steps feed back the layer's own POST-norm output (`norm_output`: the recipe's TTT loop with the hidden normed before
it is fed back, as vLLM's deepseek_mtp.py and SGLang's deepseek_nextn.py recycle it), so the head is post-norm
at every step.

    .venv/bin/python benchmarks/train_smollm2_mtp.py --prompts 160 --epochs 3   # the committed head: 23 min on 2 busy cores
    .venv/bin/python benchmarks/train_smollm2_mtp.py --quick    # 3 min, a weaker head (its step-0 drop near 2 SE)

Saved (float16) at configs/drafts/smollm2-135m-mtp/, its log at benchmarks/results/smollm2-mtp-train.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_smollm2_draft as recipe  # noqa: E402  (the built-in draft's data, captures and loss)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "configs" / "drafts" / "smollm2-135m-mtp"
LOG = ROOT / "benchmarks" / "results" / "smollm2-mtp-train.json"


def head_config(vd: int) -> dict:
    raw = recipe.draft_config(vd, [])
    del raw["eagle_config"]
    raw.update({"num_aux_hidden_states": 1, "num_nextn_predict_layers": 1, "mtp_hidden_state": "post-norm", "norm_output": True,
                "tpsim_trained": "benchmarks/train_smollm2_mtp.py (the built-in draft's recipe on the target's "
                                 "final post-norm hidden)"})
    return raw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="48 prompts, 96 tokens, 2 epochs")
    ap.add_argument("--prompts", type=int, default=160)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--ttt", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--log", type=Path, default=LOG)
    args = ap.parse_args()
    from tpsim.capture import Position
    from tpsim.capture.positions import PositionKind
    t0 = time.time()
    rng = random.Random(args.seed)
    prompts = [t.format(s=s) for s in recipe.SUBJECTS for t in recipe.TEMPLATES]
    rng.shuffle(prompts)
    prompts = prompts[:48 if args.quick else args.prompts]
    if args.quick:
        args.new_tokens, args.epochs = 96, 2
    positions = [Position(PositionKind.FINAL)]
    seqs = recipe.generate(prompts, args.new_tokens, batch=32)
    _, used, d2t, t2d = recipe.draft_vocab(seqs, args.draft_vocab)
    data = [recipe.sample(prompt, answer, cap, logits, used, t2d)
            for (prompt, answer), (cap, logits) in zip(seqs, recipe.capture(seqs, positions))]
    print(f"{len(seqs)} answers captured at {positions[0]} in {time.time() - t0:.0f} s", flush=True)

    cfg_raw = head_config(len(used))
    head = recipe.init_draft(cfg_raw, d2t, recipe.target_embedding(), args.seed)

    def epoch_end(epoch: int, log: list[dict]) -> None:
        recent = log[-len(data):]
        print(f"epoch {epoch}: acc " + " ".join(f"{sum(r['acc'][s] for r in recent) / len(recent):.2f}"
                                                 for s in range(args.ttt)) + f" ({time.time() - t0:.0f} s)", flush=True)
    log = recipe.fit(head, data, recipe.ttt_loss, args, rng, epoch_end=epoch_end)

    recipe.save_draft(head, cfg_raw, t2d, args.out)
    final = log[-len(data):]
    args.log.write_text(json.dumps({
        "args": {k: str(v.resolve().relative_to(ROOT)) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "prompts": len(seqs), "answer_tokens": sum(len(a) for _, a in seqs), "positions": [str(p) for p in positions],
        "minutes": round((time.time() - t0) / 60, 1), "threads": torch.get_num_threads(),
        "final_acc_per_step": [round(sum(r["acc"][s] for r in final) / len(final), 4) for s in range(args.ttt)],
        "log_every_25": log[::25]}, indent=1) + "\n")
    print(f"saved {args.out} in {(time.time() - t0) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
