"""`tpsim draft DIR|config.json`: what a draft checkpoint holds that a loader would trip on or silently
get wrong (tpsim.draft.checkpoint.inspect): fc's input width against the target's, d2t/t2d against each
other and the vocab, embed_tokens dropped by an export, keys no loader reads, keys missing or misshapen.

Exit 0 nothing found, 1 findings, 2 bad input.
"""

from __future__ import annotations

from tpsim.base.ui import say
from tpsim.cli.options import emit_json
from tpsim.draft.checkpoint import inspect
from tpsim.run.spec import ModelSource


def cmd_draft(args) -> int:
    target = None if args.model is None else ModelSource.load(args.model, [], []).cfg.hidden_size
    found = inspect(args.path, target)
    if args.json:
        emit_json({"ok": not found, "path": args.path, "model": args.model, "target_hidden_size": target,
                   "findings": [{"defect": f.defect.value, "cause": f.cause, "source": f.source, "fix": f.fix,
                                 "key": f.key} for f in found]})
        return 1 if found else 0
    say(f"tpsim draft: {args.path}" + (f" for target {args.model} (hidden_size {target})" if target else ""))
    for i, f in enumerate(found, 1):
        say()
        say(f"FINDING {i}: {f.defect.value}" + (f" ({f.key})" if f.key else ""))
        say(f"  cause: {f.cause}")
        say(f"  source: {f.source}")
        say(f"  fix: {f.fix}")
    say()
    say("VERDICT: nothing found" if not found else f"VERDICT: {len(found)} finding{'s' * (len(found) > 1)}")
    return 1 if found else 0
