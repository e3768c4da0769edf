"""`tpsim resolve`: layer ids -> positions, without running a model (in a convention's numbering,
or as a named engine version handles them with --server)."""

from __future__ import annotations

from tpsim.profiles import capture_only
from tpsim.profiles.conventions import Convention, ids_for, named_ids, resolve
from tpsim.cli.options import emit_json, layer_ids, positive_int
from tpsim.config.loader import DEFAULT_MODEL_TYPE, load_config
from tpsim.base.errors import UsageError
from tpsim.profiles.findings import replay_findings
from tpsim.profiles.fingerprints import unverified
from tpsim.profiles.registry import serving
from tpsim.profiles.replay import replay
from tpsim.run.spec import model_path


def cmd_resolve(args) -> int:
    if (args.convention is None) == (args.server is None):
        raise UsageError("resolve needs --convention NAME or --server PROFILE (one of them)")
    if args.enable_return_aux_hidden_states and args.server is None:
        raise UsageError("--enable-return-aux-hidden-states is SGLang's capture-only mode: give --server "
                         "sglang@VERSION[:MODEL] (0.5.23 or later)")
    if args.num_layers is None and args.model is None:
        raise UsageError("resolve needs --num-layers L or --model M")
    if args.num_layers is not None and args.model is not None:
        raise UsageError("--num-layers and --model both give the layer count; give one of them")
    cfg = None if args.model is None else load_config(model_path(args.model))
    L = positive_int(args.num_layers, "--num-layers") if cfg is None else cfg.num_hidden_layers
    if args.server is not None:
        return resolve_server(args, L, DEFAULT_MODEL_TYPE if cfg is None else cfg.model_type,
                              None if cfg is None else cfg.hidden_size)
    res = resolve(args.convention, layer_ids(args), L)
    equivalents = {}
    for conv in Convention:
        try:
            equivalents[conv.value] = ids_for(conv, res.positions, L)
        except UsageError as e:
            equivalents[conv.value] = f"unreachable: {e}"
    if args.json:
        emit_json({**res.to_dict(), "equivalent_ids": equivalents})
        return 0
    ids = "default" if res.ids is None else ",".join(map(str, res.ids))
    print(f"{named_ids(res.convention, ids)} on {L} layers -> {', '.join(map(str, res.positions))}")
    print(f"{res.internal_name}: {res.internal}")
    for n in res.notes:
        print(f"note: {n}")
    print("same positions in other conventions:")
    for conv, v in equivalents.items():
        print(f"  {conv:20} {v if isinstance(v, str) else ','.join(map(str, v))}")
    return 0


def resolve_server(args, L: int, model_type: str, hidden: int | None) -> int:
    """What the profiled engine does with the ids: each slot's fate, the capture, and what breaks.
    Exit 0 when the capture has every slot, 1 when the engine drops, refuses or crashes."""
    profile = serving(args.server, model_type)
    ids = layer_ids(args)
    refused = capture_only.served(args.server, ids, L) if args.enable_return_aux_hidden_states else None
    if refused:
        return _refused(args, profile, L, refused)
    rep = replay(profile, ids, L)
    found = [str(f) for f in replay_findings(rep, hidden)]
    if args.enable_return_aux_hidden_states:
        rep.notes.append("capture-only mode (--enable-return-aux-hidden-states): " + (
            "no --return-aux-hidden-state-layer-ids, so the model's EAGLE-3 default" if ids is None else
            "the ids passed the start-up checks in your numbering and are set as a draft's ids are (the model "
            "file's numbering decides the positions)"))
    stale = unverified(args.server, model_type)
    if args.json:
        emit_json({"server": args.server, "profile": profile.name, "versions": profile.versions.text(),
                   "num_layers": L, "ids": rep.ids, "used_default": rep.used_default,
                   "slots": [{"slot": s.index, "id": s.id, "internal": s.internal, "fate": s.fate.name.lower(),
                              "position": None if s.position is None else str(s.position)} for s in rep.slots],
                   "positions": [str(p) for p in rep.positions], "failure": rep.failure, "findings": found,
                   "notes": rep.notes + list(profile.notes), "unverified": stale and stale.to_dict(),
                   "ok": not found})
        return 1 if found else 0
    print(f"{args.server}: profile {profile.name} ({profile.versions.text()}), {L} layers")
    if stale:
        print(stale.line)
    print(f"ids {'default ' if rep.used_default else ''}{rep.ids} -> "
          f"{', '.join(map(str, rep.positions)) or 'nothing'}")
    for s in rep.slots:
        print(f"  slot {s.index}: id {s.id} -> internal {s.internal}: {s.fate.value}"
              + (f" -> {s.position}" if s.position is not None else ""))
    for n in rep.notes + list(profile.notes):
        print(f"note: {n}")
    for f in found:
        print(f"FAIL: {f}")
    return 1 if found else 0


def _refused(args, profile, L: int, why: str) -> int:
    """The server does not start in capture-only mode: nothing is captured (exit 1)."""
    if args.json:
        emit_json({"server": args.server, "profile": profile.name, "num_layers": L, "ids": layer_ids(args),
                   "positions": [], "failure": why, "findings": [why], "ok": False})
        return 1
    print(f"{args.server}: profile {profile.name} ({profile.versions.text()}), {L} layers, capture-only mode")
    print(f"FAIL: {why}")
    return 1
