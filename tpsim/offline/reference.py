"""Reading the reference `tpsim diagnose` compares a run's rank files with: a tpsim capture file,
a TP=1 rank dump, training features (`aux_hidden_states` / `hidden_states`, SpecForge's
`aux_hidden_state` / `hidden_state`, or a TP=1 SGLang dump's `value`: `[T, n*H]` or `[1, T, n*H]`,
slots named by `--positions` or split by `--hidden-size`), or a vLLM hidden-states file (slots
`slot0..`, or named by `--positions`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tpsim.capture.positions import Position
from tpsim.base.errors import UsageError
from tpsim.base.tensors import nonfinite
from tpsim.capture.files import RANK_DUMP_FORMAT
from tpsim.base.torchfile import load_pt
from tpsim.offline.dumps import VLLM_TOKENS, VllmRequest, open_safetensors, safetensors_header, vllm_request

FEATURE_KEYS = ("aux_hidden_states", "aux_hidden_state", "hidden_states", "hidden_state", "value")


@dataclass
class Reference:
    """Candidates (name -> `[T, W]`) of a reference file; aliases share the tensor object."""

    path: str
    kind: str
    candidates: dict[str, torch.Tensor]
    input_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name, t in self.candidates.items():
            if counted := nonfinite(t):
                raise UsageError(f"--reference {self.path}: {name} holds {counted}; nothing can be judged against "
                                 "it: pass a finite reference")


def parse_positions(text: str) -> list[str]:
    try:
        names = [str(Position.parse(p, 1 << 62)) for p in text.split(",")]
    except UsageError as e:
        raise UsageError(f"--positions {text!r}: {e}; write e.g. embed,out(1),out(3)") from None
    if len(set(names)) != len(names):
        raise UsageError(f"--positions {text!r} names a position twice")
    return names


def split_slots(t: torch.Tensor, names: list[str] | None, hidden: int | None, what: str) -> dict[str, torch.Tensor]:
    """`[T, n*H]` -> {slot name: `[T, H]`}, named by `names` or slot0..slot{n-1}."""
    W = t.shape[1]
    if names is None and hidden is None:
        raise UsageError(f"{what} is [{t.shape[0]}, {W}]: name its slots with --positions embed,out(1),... or "
                         f"give --hidden-size H")
    n = len(names) if names is not None else (W // hidden if hidden and W % hidden == 0 else 0)
    if n == 0 or W % n or (hidden is not None and W != n * hidden):
        got = f"{len(names)} positions" if names is not None else "slots"
        raise UsageError(f"{what} is {W} wide, which is not {got} x --hidden-size "
                         f"{hidden if hidden is not None else W // max(n, 1)}; check --positions / --hidden-size")
    names = names if names is not None else [f"slot{i}" for i in range(n)]
    return {name: c.contiguous() for name, c in zip(names, t.split(W // n, dim=1))}


def _as_2d(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2:
        raise UsageError(f"{what} is {list(t.shape)}; expected [T, n*hidden] or [1, T, n*hidden]")
    return t


def reference_num_layers(path_text: str, given: int | None) -> int | None:
    """The model's layer count for --layer-ids: `--num-layers`, else the reference's `num_layers`
    metadata (a capture that records it); both given, they must agree. None: neither says."""
    path, own = Path(path_text), None
    if path.is_file() and path.suffix == ".safetensors":
        try:
            own = safetensors_header(path)[0].get("num_layers")
        except UsageError:  # not readable: read_reference says so
            own = None
    if own is not None and not (own.isdecimal() and int(own) > 0):
        raise UsageError(f"--reference {path}: metadata num_layers={own!r} is not a positive integer; write the "
                         f"capture again")
    own = None if own is None else int(own)
    if given is not None and own is not None and given != own:
        raise UsageError(f"--num-layers {given} differs from the reference's num_layers={own} ({path}); drop "
                         f"--num-layers")
    return given if given is not None else own


def read_reference(path_text: str, positions: list[str] | None, hidden: int | None) -> Reference:
    path = Path(path_text)
    if not path.is_file():
        raise UsageError(f"--reference {path} does not exist" if not path.exists() else f"--reference {path} is not a file")
    if path.suffix == ".safetensors":
        meta, tensors, _ = open_safetensors(path)
    else:
        obj = load_pt(path)
        meta, tensors = {}, (obj if isinstance(obj, dict) else {"hidden_states": obj})
        tensors = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    ids = tensors.get("input_ids")
    ids = ids.flatten() if ids is not None else None
    if meta.get("format") == RANK_DUMP_FORMAT:
        if meta.get("tp") != "1":
            raise UsageError(f"--reference {path} is a tp={meta.get('tp')} rank dump; a reference rank dump must be "
                             f"TP=1 (every point whole)")
        cands = {n: t for n, t in tensors.items() if n != "input_ids" and t.dim() == 2}
        cands.update({meta[f"position.{n}"]: t for n, t in list(cands.items()) if f"position.{n}" in meta})
        return Reference(str(path), "TP=1 rank dump", cands, ids)
    if VLLM_TOKENS in tensors:
        return vllm_reference(vllm_request(path, tensors, f"--reference {path}"), positions, hidden)
    key = next((k for k in FEATURE_KEYS if k in tensors), None)
    if key is None:
        raise UsageError(f"--reference {path} holds no aux_hidden_states / hidden_states tensor (found: "
                         f"{', '.join(tensors) or 'nothing'}); pass a capture, a TP=1 rank dump or features")
    t = _as_2d(tensors[key], f"--reference {path}: {key}")
    if "positions" in meta:
        own = [p.strip() for p in meta["positions"].split(",")]
        if positions is not None and positions != own:
            raise UsageError(f"--positions {','.join(positions)} differs from the capture's own positions "
                             f"{','.join(own)}; drop --positions")
        slots = split_slots(t, own, hidden, f"--reference {path}")
        return Reference(str(path), "capture file", with_slot_names(slots) if vllm_order(meta) else slots, ids)
    return Reference(str(path), "training features", split_slots(t, positions, hidden, f"--reference {path}: {key}"),
                     ids)


def vllm_order(meta: dict[str, str]) -> bool:
    """A capture made with vLLM's convention (`--convention vllm-ids`, or `--server vllm...`, which writes the
    profile's name `vllm@VERSION:MODEL`; captures from before the convention's rename say `vllm`): its slots
    are in the order vLLM writes its aux layers."""
    return meta.get("convention", "").partition("@")[0].partition(":")[0] in ("vllm", "vllm-ids")


def with_slot_names(slots: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The slots, then `slot{i}` for the i-th (the same tensor): what a vLLM file's slot i is compared with."""
    return {**slots, **{f"slot{i}": t for i, t in enumerate(slots.values())}}


def vllm_reference(req: VllmRequest, positions: list[str] | None, hidden: int | None) -> Reference:
    """A vLLM hidden-states file as the reference: slots `slot{i}`, or named by --positions (and also `slot{i}`)."""
    T, n, H = req.hidden_states.shape
    what = f"--reference {req.path}"
    if hidden is not None and hidden != H:
        raise UsageError(f"--hidden-size {hidden}: {what} holds hidden size {H} ([{T}, {n}, {H}]); drop --hidden-size")
    if positions is not None and len(positions) != n:
        raise UsageError(f"--positions names {len(positions)} slots; {what} holds {n} ([{T}, {n}, {H}]); name each "
                         f"once, in the file's order")
    slots = split_slots(req.hidden_states.reshape(T, n * H), positions, H, what)
    return Reference(str(req.path), "vLLM hidden-states file",
                     slots if positions is None else with_slot_names(slots), req.token_ids)


