"""`tpsim draft` and `tpsim triage --draft-config` on an MTP/NextN head (tpsim.app.draft_mtp): what it was
trained on against what each served engine version feeds it, printed as findings with their replayed fix."""

from __future__ import annotations

from pathlib import Path

from tpsim.app.draft_mtp import ASSUMED, head_of, mtp_findings
from tpsim.base.ui import say
from tpsim.cli.findings import say_finding
from tpsim.cli.options import emit_json


def cmd_mtp(path: Path, raw: dict, servers: list[str], as_json: bool = False, summary: bool = False,
            command: str = "draft") -> int:
    """Exit 1 on findings, else 0."""
    head = head_of(raw, str(path))
    found, unverified = mtp_findings(head, servers)
    verdict = f"VERDICT: {len(found)} finding{'s' * (len(found) > 1)}" if found else "VERDICT: nothing found"
    if summary:
        print(f"tpsim {command}: {verdict}")
    elif as_json:
        emit_json({"ok": not found, "path": str(path), "mtp_head": head.architecture,
                   "trained_on": {"step0": head.step0.value, "later": head.later.value}, "declared": head.declared,
                   "findings": [f.to_dict() for f in found], "unverified": unverified})
    else:
        say(f"tpsim {command}: {path}: an MTP head ({head.architecture or 'no architectures'}), trained on the "
            f"{head.step0.value} hidden at step 0 and the {head.later.value} one at steps 1+")
        if not head.declared:
            say(f"assumed: {ASSUMED}")
        for i, f in enumerate(found, 1):
            say_finding(i, f.title, f.cause, list(f.sources), f.fix)
        say()
        say(verdict)
        for u in unverified:
            say(f"not checked: {u}")
    return 1 if found else 0
