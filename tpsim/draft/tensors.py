"""What a draft's tensors hold, past their names and shapes: a dtype the tensor cannot be (a bool lm_head, a float
d2t), NaN or Inf values, one tensor held by two weight files with different values. `tpsim.draft.checkpoint.inspect`
lists these findings with the rest; `merge` gathers a checkpoint's files and notes the conflicts."""

from __future__ import annotations

import torch

from tpsim.base.tensors import bitwise_equal, nonfinite
from tpsim.draft.findings import DraftDefect, DraftFinding

COPIED = ("sglang python/sglang/srt/model_loader/weight_utils.py default_weight_loader (vLLM's alike): "
          "param.data.copy_(loaded_weight), which casts any dtype")
HOT_IDS = ("sglang models/llama_eagle3.py LlamaForCausalLMEagle3.load_weights (0.5.6 .. 0.5.23): d2t becomes "
           "hot_token_id = d2t + arange, token ids; vLLM llama_eagle3.py reads it as draft_id_to_target_id")
SHARDS = "a checkpoint's safetensors shards hold each tensor once (model.safetensors.index.json maps a name to one file)"
PROPAGATES = "IEEE 754: a NaN propagates through every sum and product it enters, and so does an Inf (to NaN or Inf)"


def merge(tensors: dict[str, torch.Tensor], where: dict[str, str], conflicts: dict[str, tuple[str, ...]],
          got: dict[str, torch.Tensor], file: str) -> None:
    """Adds one file's tensors to `tensors` (`where`: the file each came from); a name read before from another
    file with other dtype, shape or bits goes into `conflicts` with every file that disagrees, the later value
    kept as a loader would."""
    for name, t in got.items():
        old = tensors.get(name)
        # reshape: bitwise_equal views a tensor as bytes, which torch refuses for a 0-dim one
        if old is not None and not (old.shape == t.shape and bitwise_equal(old.reshape(-1), t.reshape(-1))):
            conflicts[name] = (*conflicts.get(name, (where[name],)), file)
        tensors[name], where[name] = t, file


def tensor_findings(tensors: dict[str, torch.Tensor], read: set[str],
                    conflicts: dict[str, tuple[str, ...]]) -> list[DraftFinding]:
    """Dtype, non-finite and conflict findings for the tensors a loader reads (`read`: their names)."""
    out = []
    for name in sorted(read & set(tensors)):
        out += _dtype(name, tensors[name]) or _nonfinite(name, tensors[name])
    return out + [_conflict(name, files) for name, files in sorted(conflicts.items()) if name in read]


def _dtype(name: str, t: torch.Tensor) -> list[DraftFinding]:
    integer = not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
    if name == "d2t" and not integer:
        return [DraftFinding(DraftDefect.DTYPE, f"d2t is {_short(t.dtype)}, not an integer dtype: its offsets make "
                             "token ids", HOT_IDS, "re-export d2t as int64 (SpecForge writes used_tokens - arange)",
                             name)]
    if name == "t2d" and not (integer or t.dtype == torch.bool):
        return [DraftFinding(DraftDefect.DTYPE, f"t2d is {_short(t.dtype)}, not a bool mask", HOT_IDS,
                             "re-export t2d as bool", name)]
    if name not in ("d2t", "t2d") and not t.is_floating_point():
        return [DraftFinding(DraftDefect.DTYPE, f"{name} is {_short(t.dtype)}, not floating point: a loader casts it "
                             "into the draft's floating-point parameter" + (" as 0 and 1" if t.dtype == torch.bool
                                                                             else "") + ", not the trained weight",
                             COPIED, "re-export the draft with its weights in bf16 or fp32", name)]
    return []


def _nonfinite(name: str, t: torch.Tensor) -> list[DraftFinding]:
    counted = nonfinite(t)
    if not counted:
        return []
    first = (~torch.isfinite(t)).nonzero()[0].tolist()
    return [DraftFinding(DraftDefect.NON_FINITE, f"{name} holds {counted} (the first at {first}): what the draft "
                         "computes through it is NaN or Inf, and so are the proposals it makes", PROPAGATES,
                         "re-export the draft from a training checkpoint whose weights are finite (a NaN weight "
                         "usually means the run diverged)", name)]


def _conflict(name: str, files: tuple[str, ...]) -> DraftFinding:
    return DraftFinding(DraftDefect.CONFLICT, f"{name} is in {' and '.join(files)} with different values: a loader "
                        "keeps the copy in whichever file it reads last", SHARDS,
                        f"delete whichever of {', '.join(files)} is stale, or re-export the draft into an empty directory",
                        name)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
