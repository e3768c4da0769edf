"""Reading an EAGLE-3 draft directory in SpecForge's layout (config.json + *.safetensors; keys `fc.weight`,
`midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`, optional `embed_tokens.weight`; research doc
§2.2) or the speculators format vLLM reads (`layers.0.*` for `midlayer.*`, tpsim.draft.config.Layout) into
`Eagle3Draft`, and `inspect`, which lists what is wrong with it (`runnable`: refused in one line when that makes
running it meaningless). Tensors are held under SpecForge's names."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from tpsim.base.errors import UsageError, read_text
from tpsim.base.torchfile import load_pt

from tpsim.draft.config import DraftConfig, Layout
from tpsim.draft.findings import DraftDefect, DraftFinding
from tpsim.draft.model import Eagle3Draft
from tpsim.draft.tensors import merge, tensor_findings
from tpsim.draft.weights import load, specs
from tpsim.parallel.group import TPGroup

SPECFORGE = "SpecForge specforge/modeling/draft/llama3_eagle.py (research doc §2.2)"
EXPORT_WARNING = ("SpecForge export: \"a key the serving loader does not expect is skipped (or zero-filled) "
                  "without an error\" (_REQUIRED_SERVING_KEYS)")
VOCAB_KEYS = ("d2t", "t2d")
EAGLE_BIN = "pytorch_model.bin"
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")
# what makes a measurement on the draft meaningless; the rest leaves the draft the engines run as it is (no
# embed_tokens: the target's is used; a key no loader reads: skipped), and so does any finding on t2d, which no
# engine's draft loader reads (tpsim.profiles.loader_lines) and tpsim's draft does not either (ids go through d2t)
UNRUNNABLE = frozenset({DraftDefect.NON_FINITE, DraftDefect.DTYPE, DraftDefect.CONFLICT, DraftDefect.VOCAB_MAP,
                        DraftDefect.MISSING_KEY, DraftDefect.SHAPE, DraftDefect.FC_WIDTH})


@dataclass(frozen=True)
class DraftCheckpoint:
    path: Path
    config: DraftConfig
    tensors: dict[str, torch.Tensor]  # under SpecForge's names, whatever the layout on disk
    layout: Layout = Layout.SPECFORGE
    raw: dict = field(default_factory=dict)  # config.json as written (the keys each engine reads ids from)
    weights: bool = True  # False: config.json alone (`read(..., config_alone=True)`), no tensors to check
    conflicts: dict[str, tuple[str, ...]] = field(default_factory=dict)  # a tensor -> the files holding other values


def read(path: str | Path, config_alone: bool = False, needs: str = "") -> DraftCheckpoint:
    """`path`: the draft directory, or its config.json (UsageError, one line, on anything unreadable).
    `config_alone`: a config.json with no weights beside it is read as the config alone (`weights` False), else
    refused; `needs`: what the caller does with the weights, for that refusal."""
    path = Path(path)
    if path.is_file() and path.suffix in WEIGHT_FILES:
        raise UsageError(f"{path} is a weights file, not a draft: give the directory that holds it and the draft's "
                         f"config.json ({path.parent})")
    folder = path.parent if path.is_file() else path
    config_file = path if path.is_file() else folder / "config.json"  # a config under another name: the config alone
    fix = "give the draft's directory (config.json and *.safetensors) or its config.json"
    if not config_file.is_file():
        raise UsageError(f"{path}: no draft config.json there; {fix}")
    text = read_text(config_file, "draft config", "JSON", fix)
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise UsageError(f"{config_file} is not a JSON draft config ({str(e).splitlines()[0][:80]}); {fix}") \
            from None
    except RecursionError:
        raise UsageError(f"{config_file} is not a config.json (JSON nested too deeply to read); {fix}") from None
    config = DraftConfig.from_json(raw, str(config_file))
    files = sorted(folder.glob("*.safetensors")) if config_file.name == "config.json" else []
    layout = Layout.of(raw)
    if not files and (folder / EAGLE_BIN).is_file():
        files, layout = [folder / EAGLE_BIN], Layout.EAGLE
    if not files and config_alone:
        return DraftCheckpoint(folder, config, {}, layout, raw, weights=False)
    if not files:
        raise UsageError(f"{folder}: no *.safetensors (or the EAGLE repository's {EAGLE_BIN}) beside config.json"
                         f"{needs}; give the draft's directory with its weights (tpsim draft checks a config alone)")
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    conflicts: dict[str, tuple[str, ...]] = {}
    for f in files:
        merge(tensors, where, conflicts, _renamed(_tensors(f, fix), layout), f.name)
    return DraftCheckpoint(folder, config, tensors, layout, raw, conflicts=conflicts)


def runnable(path: str | Path, needs: str) -> DraftCheckpoint:
    """The draft at `path`, read for a command that runs its weights (`needs`: what it does with them, for `read`'s
    refusal); UsageError, one line before any rank starts, on a finding that makes the run meaningless."""
    ckpt = read(path, needs=needs)
    broken = [f for f in inspect(ckpt) if f.defect in UNRUNNABLE and f.key != "t2d"]
    if broken:
        first, more = broken[0], len(broken) - 1
        also = f" (and {more} more finding{'s' * (more > 1)})" if more else ""
        raise UsageError(f"{ckpt.path}: the draft cannot be run as it stands: {first.title}: {first.cause}{also}; "
                         f"{first.fix}, then check it with tpsim draft {ckpt.path}")
    return ckpt


def _renamed(tensors: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """Under SpecForge's names (the speculators layout's `layers.0.*` as `midlayer.*`)."""
    prefix = layout.layer_prefix
    return {"midlayer." + k.removeprefix(prefix) if k.startswith(prefix) else k: v for k, v in tensors.items()}


def _tensors(f: Path, fix: str) -> dict[str, torch.Tensor]:
    """One weights file: safetensors, or EAGLE's pytorch_model.bin."""
    if f.name == EAGLE_BIN:
        return _state_dict(f)
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise UsageError(f"{f} is not a readable safetensors file ({str(e).splitlines()[0][:80]}); {fix}") from None


def _state_dict(f: Path) -> dict[str, torch.Tensor]:
    """EAGLE's pytorch_model.bin, read with weights_only (tensors, nothing that runs code: SafeAILab/EAGLE
    eagle/model/ea_model.py @47de7b0e `EaModel.from_pretrained` torch.loads it, else model.safetensors): dense
    tensors under string names, else one line."""
    fix = "save the draft's state dict (string names, dense tensors) with torch.save, or export it as *.safetensors"
    if f.stat().st_size == 0:
        raise UsageError(f"{f} is empty (0 bytes); {fix}")
    got = load_pt(f, fix)
    why = _not_a_state_dict(got)
    if why:
        raise UsageError(f"{f} is not a readable state dict ({why}); {fix}")
    return got


def _not_a_state_dict(got) -> str:
    """'' for a dict of dense tensors under string names, else what it holds instead."""
    if not isinstance(got, dict) or not all(isinstance(v, torch.Tensor) for v in got.values()):
        return "it holds no state dict of tensors"
    for k, v in got.items():
        if not isinstance(k, str):
            return f"its key {k!r} ({type(k).__name__}) is not a tensor name"
        if hollow := _hollow(v):
            return f"tensor {k} is {hollow}, not a dense tensor of values"
    return ""


def _hollow(t: torch.Tensor) -> str:
    """'' for a dense tensor that holds its values, else what it is instead."""
    if t.is_meta:
        return "on the meta device (shape only, no values)"
    if t.layout != torch.strided:
        return f"sparse ({t.layout})"
    return "quantized" if t.is_quantized else ""


def build(ckpt: DraftCheckpoint, embed: torch.Tensor | None = None, device: str = "cpu") -> Eagle3Draft:
    """The draft with the checkpoint's weights, on `device`; `embed`: the target's `[V, H]` embedding, for a draft
    exported without its own (EMBED_ABSENT). Raises on a shape `inspect` reports, or on no embedding at all."""
    tensors = dict(ckpt.tensors)
    if embed is not None:
        tensors["embed_tokens.weight"] = embed
    if "embed_tokens.weight" not in tensors:
        raise ValueError(f"{ckpt.path}: no embed_tokens.weight; pass the target's embedding (embed=)")
    model = Eagle3Draft(ckpt.config, TPGroup(device=torch.device(device)))
    load(model, tensors)
    return model


def inspect(path: str | Path | DraftCheckpoint, target_hidden: int | None = None) -> list[DraftFinding]:
    """Every finding for the draft at `path` (or already `read`); `target_hidden`: the target's hidden size, when
    known (else the config's `target_hidden_size`, else its `hidden_size`)."""
    ckpt = path if isinstance(path, DraftCheckpoint) else read(path)
    if not ckpt.weights:
        return _declared_width(ckpt, target_hidden)
    places = specs(Eagle3Draft(ckpt.config, TPGroup(device=torch.device("meta"))))  # shapes only, no memory
    return [*_fc_width(ckpt, target_hidden), *_vocab_map(ckpt), *_keys(ckpt, places),
            *tensor_findings(ckpt.tensors, set(places) | set(VOCAB_KEYS), ckpt.conflicts)]


def _declared_width(ckpt: DraftCheckpoint, target_hidden: int | None) -> list[DraftFinding]:
    """A config alone: the fc width it declares (num_aux x target_hidden_size) against the target's."""
    cfg = ckpt.config
    if target_hidden is None or cfg.target_hidden_size == target_hidden:
        return []
    return [DraftFinding(
        DraftDefect.FC_WIDTH,
        f"config.json declares target_hidden_size {cfg.target_hidden_size} (fc takes {cfg.num_aux} x "
        f"{cfg.target_hidden_size} = {cfg.capture_width} inputs) but the target's hidden size is {target_hidden}: "
        f"the capture is {cfg.num_aux * target_hidden} wide",
        f"{SPECFORGE} (fc = Linear(3*target_hidden_size, hidden_size)); research doc §2.3 step 2",
        "serve the draft with the target it was trained for, or fix target_hidden_size in config.json",
        "target_hidden_size")]


def _fc_width(ckpt: DraftCheckpoint, target_hidden: int | None) -> list[DraftFinding]:
    fc = ckpt.tensors.get("fc.weight")
    if fc is None or fc.dim() != 2:
        return []
    cfg = ckpt.config
    ht = target_hidden or cfg.target_hidden_size
    expected = cfg.num_aux * ht
    if fc.shape[1] == expected:
        return []
    whence = (f"{len(cfg.aux_layer_ids)} aux layer ids {list(cfg.aux_layer_ids)}" if cfg.aux_layer_ids
              else "3 captured layers (no ids in the config: the engines' default)")
    fits = f"; it fits {fc.shape[1] // ht} captures" if fc.shape[1] % ht == 0 else ""
    return [DraftFinding(
        DraftDefect.FC_WIDTH,
        f"fc.weight takes {fc.shape[1]} inputs but the capture is {whence} x target hidden {ht} = {expected}{fits}",
        f"{SPECFORGE} (fc = Linear(3*target_hidden_size, hidden_size)); research doc §2.3 step 2",
        "capture as many layers as the draft was trained on (set eagle_aux_hidden_state_layer_ids), or fix "
        "target_hidden_size in config.json", "fc.weight")]


def _vocab_map(ckpt: DraftCheckpoint) -> list[DraftFinding]:
    cfg, t = ckpt.config, ckpt.tensors
    d2t, t2d = t.get("d2t"), t.get("t2d")
    out = []
    source = "EAGLE training: d2t = used_tokens[i] - i, t2d marks the draft's target ids (research doc §2.2)"

    def finding(cause: str, key: str) -> DraftFinding:
        return DraftFinding(DraftDefect.VOCAB_MAP, cause, source,
                            "re-export d2t and t2d together from the same token-frequency map", key)

    if d2t is not None:
        if d2t.shape != (cfg.draft_vocab_size,):
            out.append(finding(f"d2t has shape {tuple(d2t.shape)}, draft_vocab_size is {cfg.draft_vocab_size}", "d2t"))
        else:
            targets = torch.arange(len(d2t)) + d2t.long()
            outside = ((targets < 0) | (targets >= cfg.vocab_size)).nonzero().flatten().tolist()
            if outside:
                i = outside[0]
                out.append(finding(f"d2t maps {len(outside)} draft id{'s' * (len(outside) > 1)} outside the target "
                                   f"vocab [0, {cfg.vocab_size}), the first draft id {i} to {int(targets[i])} "
                                   f"(offset {int(d2t[i])})", "d2t"))
            elif len(torch.unique(targets)) != len(targets):
                out.append(finding("d2t maps two draft ids to the same target id", "d2t"))
            elif t2d is not None and t2d.shape == (cfg.vocab_size,):
                if not bool(t2d.bool()[targets].all()) or int(t2d.bool().sum()) != len(targets):
                    out.append(finding("t2d does not mark exactly the target ids d2t maps to", "t2d"))
    if t2d is not None and t2d.shape != (cfg.vocab_size,):
        out.append(finding(f"t2d has shape {tuple(t2d.shape)}, vocab_size is {cfg.vocab_size}", "t2d"))
    return out


def _keys(ckpt: DraftCheckpoint, places: dict) -> list[DraftFinding]:
    out = []
    if "embed_tokens.weight" not in ckpt.tensors:
        out.append(DraftFinding(
            DraftDefect.EMBED_ABSENT,
            "no embed_tokens.weight: the draft's token embedding must come from elsewhere (the target's), and "
            "a loader that does not fetch it runs the draft on whatever the embedding was initialised to",
            "SpecForge export/to_sglang.py drops every key containing \"embed\"; export/to_hf.py re-adds it "
            "(research doc §2.2)",
            "re-export with SpecForge export/to_hf.py --embedding-source TARGET, or copy the target's "
            "embed_tokens.weight into the draft", "embed_tokens.weight"))
    for name in sorted(set(places) - set(ckpt.tensors) - {"embed_tokens.weight"}):
        out.append(DraftFinding(DraftDefect.MISSING_KEY, f"{name} is absent but the config calls for it",
                                EXPORT_WARNING, f"re-export the draft with {name}", name))
    for name in VOCAB_KEYS:
        if name not in ckpt.tensors and ckpt.config.draft_vocab_size != ckpt.config.vocab_size:
            out.append(DraftFinding(DraftDefect.MISSING_KEY, f"{name} is absent with draft_vocab_size "
                                    f"{ckpt.config.draft_vocab_size} < vocab_size {ckpt.config.vocab_size}",
                                    EXPORT_WARNING, f"re-export the draft with {name}", name))
    for name, tensor in sorted(ckpt.tensors.items()):
        if name in VOCAB_KEYS:
            continue
        if name not in places:
            out.append(DraftFinding(DraftDefect.IGNORED_KEY,
                                    f"{name} {tuple(tensor.shape)} has no place in the draft this config "
                                    "describes: a loader building that draft skips it without an error",
                                    EXPORT_WARNING,
                                    "rename it to the layout's key (midlayer.*, fc, norm, lm_head) or drop it", name))
        elif _misshapen(name, tuple(tensor.shape), places[name].shape):
            out.append(DraftFinding(DraftDefect.SHAPE, f"{name} has shape {tuple(tensor.shape)}, the config implies "
                                    f"{places[name].shape}", SPECFORGE, "make config.json match the weights", name))
    return out


def _misshapen(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    if name == "fc.weight" and len(shape) == 2:  # its input width is `_fc_width`'s finding
        return shape[0] != expected[0]
    return shape != expected
