"""`tpsim draft DIR|config.json`: what a draft checkpoint holds that a loader would trip on or silently
get wrong (tpsim.draft.checkpoint.inspect): fc's input width against the target's, d2t/t2d against each
other and the vocab, embed_tokens dropped by an export, keys no loader reads, keys missing or misshapen;
what each engine version's draft loader does with it and the key it reads the layer ids from
(tpsim.app.draft_served, tpsim.app.draft_engines): the versions --server names, else every profiled release.
A config.json with no weights beside it is checked as a config alone (tpsim.app.draft_request).

Exit 0 nothing found, 1 findings, 2 bad input.
"""

from __future__ import annotations

from tpsim.app.asks import draft_path
from tpsim.app.draft_mtp import mtp_config
from tpsim.app.draft_request import CopyRequest, DraftRequest, DraftResult, run_copy, run_draft
from tpsim.base.errors import UsageError
from tpsim.base.ui import say
from tpsim.cli.draft_mtp import cmd_mtp
from tpsim.app.block_draft import block_config
from tpsim.cli.block_draft import run_block
from tpsim.cli.findings import say_finding
from tpsim.cli.options import emit_json
from tpsim.cli.parser import refuse_without
from tpsim.cli.run_args import served_tp
from tpsim.profiles.profile import Platform

CHECKING = {"model": "--model", "server": "--server", "tp": "--tp", "json": "--json", "summary": "--summary",
            "platform": "--platform"}


def request(args) -> DraftRequest | CopyRequest:
    """argv as the typed request."""
    refuse_without(args, "--copy", args.copy is not None, {"force": "--force"})
    if args.copy is not None:
        checking = [o for d, o in CHECKING.items() if d in getattr(args, "given", ())]
        if checking:
            raise UsageError(f"--copy copies the draft and checks nothing: leave {checking[0]} out (check the copy "
                             "afterwards)")
        return CopyRequest(args.path, args.copy, args.force)
    servers = tuple(t for given in args.server or [] for t in given.split(","))
    platform = None if args.platform is None else Platform(args.platform)
    if platform is not None and not any(s.split("@")[0] == "sglang" for s in servers):
        raise UsageError(f"--platform {platform.value} chooses SGLang's verify branch: name an SGLang version with "
                         "--server (e.g. --server sglang@0.5.17), or leave --platform out")
    tp = served_tp(args)
    if platform is not None and tp == 1:
        raise UsageError(f"--platform {platform.value} replays SGLang's verify over TP ranks: give --tp 2 or more "
                         "(at TP 1 every rank is the one rank)")
    return DraftRequest(args.path, args.model, servers, tp, platform)


def cmd_draft(args) -> int:
    block = None if args.copy is not None else block_config(args.path)
    if block is not None:  # a DFlash or DSpark draft: the taps each engine takes (tpsim.cli.block_draft)
        return run_block(args, *block, "draft")
    req = request(args)
    if isinstance(req, CopyRequest):
        say(f"copied {req.path} ({', '.join(run_copy(req))}) to {req.dest}")
        return 0
    if (raw := mtp_config(draft_path(req.path))) is not None:  # an MTP head: what it is fed, not an EAGLE-3 loader
        return cmd_mtp(draft_path(req.path), raw, list(req.servers), args.json, args.summary)
    r = run_draft(req)
    if args.summary:
        print(f"tpsim draft: {verdict(r)}" + (f" ({'; '.join(f.title for f in r.findings)})" if r.findings else ""))
    elif args.json:
        emit_json({"ok": not r.findings, "path": req.path, "model": req.model, "target_hidden_size": r.target_hidden,
                   "servers": r.servers, "tp": req.tp, "replayed": r.replayed, "assumed": r.assumed,
                   "config_alone": r.config_alone,
                   "not_checked": r.not_checked, "warnings": [f.to_dict() for f in r.warnings],
                   "findings": [f.to_dict() for f in r.findings]})
    else:
        print_draft(r, req)
    return 1 if r.findings else 0


def verdict(r: DraftResult) -> str:
    n = len(r.findings)
    return "VERDICT: nothing found" if not n else f"VERDICT: {n} finding{'s' * (n > 1)}"


def print_draft(r: DraftResult, req: DraftRequest) -> None:
    say(f"tpsim draft: {req.path}{' (the config alone: no weights beside it)' if r.config_alone else ''}"
        + (f" for target {req.model} (hidden_size {r.target_hidden})" if r.target_hidden else "")
        + f", served by {', '.join(r.servers)} at TP {req.tp}")
    for a in r.assumed:
        say(f"assumed: {a}")
    for i, f in enumerate(r.findings, 1):
        say_finding(i, f.title, f.cause, [f.source], f.fix)
    for w in r.warnings:
        say(f"WARNING: {w.title}: {w.cause}; safeguard: {w.fix}")
    for note in r.replayed:
        say(f"replayed: {note}")
    say()
    say(verdict(r))
    for u in r.not_checked:
        say(f"not checked: {u}")
