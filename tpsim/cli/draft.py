"""`tpsim draft DIR|config.json`: what a draft checkpoint holds that a loader would trip on or silently
get wrong (tpsim.draft.checkpoint.inspect): fc's input width against the target's, d2t/t2d against each
other and the vocab, embed_tokens dropped by an export, keys no loader reads, keys missing or misshapen;
with --server, what each named engine version's draft loader does with it (tpsim.app.draft_served).

Exit 0 nothing found, 1 findings, 2 bad input.
"""

from __future__ import annotations

from tpsim.app.draft_served import served_findings, target_embedding
from tpsim.base.ui import say
from tpsim.cli.findings import say_finding
from tpsim.cli.options import emit_json, positive_int
from tpsim.cli.parser import refuse_without
from tpsim.cli.run_args import served_tp
from tpsim.cli.served import draft_dir
from tpsim.draft.checkpoint import inspect, read
from tpsim.profiles.loader_lines import lookup
from tpsim.profiles.vllm import loader_assumed
from tpsim.run.spec import ModelSource


def cmd_draft(args) -> int:
    servers = [lookup(t.strip()) for given in args.server or [] for t in given.split(",") if t.strip()]
    refuse_without(args, "--server", bool(servers), {"tp": "--tp"})
    tp = served_tp(args)
    source = None if args.model is None else ModelSource.load(args.model, [], [])
    target = None if source is None else source.cfg.hidden_size
    ckpt = read(draft_dir(args.path))
    found = inspect(ckpt, target)
    if servers:
        found = served_findings(ckpt, found, servers, None if source is None else target_embedding(source), tp)
    names = [s.name for s in servers]
    runners = [a for s in servers if (a := loader_assumed(s.name)) is not None]
    if args.json:
        emit_json({"ok": not found, "path": args.path, "model": args.model, "target_hidden_size": target,
                   "servers": names, "tp": tp, "assumed": runners, "findings": [f.to_dict() for f in found]})
        return 1 if found else 0
    say(f"tpsim draft: {args.path}" + (f" for target {args.model} (hidden_size {target})" if target else "")
        + (f", served by {', '.join(names)} at TP {tp}" if names else ""))
    for a in runners:
        say(f"note: assumed: {a}")
    for i, f in enumerate(found, 1):
        say_finding(i, f.title, f.cause, [f.source], f.fix)
    say()
    say("VERDICT: nothing found" if not found else f"VERDICT: {len(found)} finding{'s' * (len(found) > 1)}")
    return 1 if found else 0
