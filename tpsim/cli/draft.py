"""`tpsim draft DIR|config.json`: what a draft checkpoint holds that a loader would trip on or silently
get wrong (tpsim.draft.checkpoint.inspect): fc's input width against the target's, d2t/t2d against each
other and the vocab, embed_tokens dropped by an export, keys no loader reads, keys missing or misshapen;
what each engine version's draft loader does with it and the key it reads the layer ids from
(tpsim.app.draft_served, tpsim.app.draft_engines): the versions --server names, else every profiled release.
A config.json with no weights beside it is checked as a config alone.

Exit 0 nothing found, 1 findings, 2 bad input.
"""

from __future__ import annotations

from pathlib import Path

from tpsim.app.draft_copy import copy_draft
from tpsim.app.draft_engines import every_release, ids_findings
from tpsim.app.draft_served import served_findings, target_embedding
from tpsim.base.errors import UsageError
from tpsim.base.ui import say
from tpsim.cli.findings import say_finding
from tpsim.cli.options import emit_json
from tpsim.cli.parser import refuse_without
from tpsim.cli.run_args import served_tp
from tpsim.cli.served import draft_dir
from tpsim.draft.checkpoint import inspect, read
from tpsim.offline.align import read_draft_config
from tpsim.profiles.loader_lines import LINES, lookup
from tpsim.profiles.vllm import loader_assumed
from tpsim.run.spec import ModelSource

CHECKING = {"model": "--model", "server": "--server", "tp": "--tp", "json": "--json", "summary": "--summary"}
SWEPT = ("vLLM's ids read as by the runner a CUDA GPU with Triton gets (--server vllm-cpu@VERSION: a machine without "
         "Triton)")
TRIAGE = ("the served mode and the capture under TP (flags, communication, a trainer other than SpecForge): tpsim "
          "triage --draft-config FILE --server ENGINE@VERSION --model TARGET")
IDS = "which layers the ids capture on the target, against what training captured: give --model TARGET"
WROTE = "the ids were written by SpecForge's current code (triage's default --train): what it captures is the trained"
UNCHECKED = "the weights (fc, embed_tokens, d2t, norms, every tensor's shape): give the draft's directory"


def cmd_draft(args) -> int:
    refuse_without(args, "--copy", args.copy is not None, {"force": "--force"})
    if args.copy is not None:
        checking = [o for d, o in CHECKING.items() if d in getattr(args, "given", ())]
        if checking:
            raise UsageError(f"--copy copies the draft and checks nothing: leave {checking[0]} out (check the copy "
                             "afterwards)")
        source = draft_dir(args.path)
        read_draft_config(str(source))  # a draft config tpsim reads, or one line saying why not
        names = copy_draft(source, Path(args.copy), args.force)
        say(f"copied {args.path} ({', '.join(names)}) to {args.copy}")
        return 0
    servers = [lookup(t.strip()) for given in args.server or [] for t in given.split(",") if t.strip()]
    tp = served_tp(args)
    source = None if args.model is None else ModelSource.load(args.model, [], [])
    target = None if source is None else source.cfg.hidden_size
    model_type = "llama" if source is None else source.cfg.model_type
    layers = None if source is None else source.cfg.num_hidden_layers
    ckpt = read(draft_dir(args.path), config_alone=True)
    found = inspect(ckpt, target)
    embed = None if source is None or not ckpt.weights else target_embedding(source)
    if servers:
        found = served_findings(ckpt, found, servers, embed, tp) + ids_findings(ckpt, servers, model_type, layers)
    else:
        found = every_release(ckpt, found, embed, tp, model_type, layers)
    names = [s.name for s in servers] or [f"every {e} release read ({LINES[e].oldest} to {LINES[e].newest})"
                                          for e in LINES]
    runners = ([a for s in servers if (a := loader_assumed(s.name)) is not None] if servers else [SWEPT]) + \
        ([] if source is None else [WROTE])
    unchecked = ([] if ckpt.weights else [UNCHECKED]) + ([IDS] if source is None else []) + [TRIAGE]
    warnings, found = [f for f in found if f.warning], [f for f in found if not f.warning]
    if args.summary:
        print("tpsim draft: VERDICT: " + ("nothing found" if not found else f"{len(found)} finding"
              f"{'s' * (len(found) > 1)} ({'; '.join(f.title for f in found)})"))
        return 1 if found else 0
    if args.json:
        emit_json({"ok": not found, "path": args.path, "model": args.model, "target_hidden_size": target,
                   "servers": names, "tp": tp, "assumed": runners, "config_alone": not ckpt.weights,
                   "not_checked": unchecked, "warnings": [f.to_dict() for f in warnings], "findings": [f.to_dict() for f in found]})
        return 1 if found else 0
    say(f"tpsim draft: {args.path}{' (the config alone: no weights beside it)' if not ckpt.weights else ''}"
        + (f" for target {args.model} (hidden_size {target})" if target else "")
        + f", served by {', '.join(names)} at TP {tp}")
    for a in runners:
        say(f"assumed: {a}")
    for i, f in enumerate(found, 1):
        say_finding(i, f.title, f.cause, [f.source], f.fix)
    for w in warnings:
        say(f"WARNING: {w.title}: {w.cause}; safeguard: {w.fix}")
    say()
    say("VERDICT: nothing found" if not found else f"VERDICT: {len(found)} finding{'s' * (len(found) > 1)}")
    for u in unchecked:
        say(f"not checked: {u}")
    return 1 if found else 0
