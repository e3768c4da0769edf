"""`tpsim verify FILE|DIR...`: check that files tpsim wrote are whole and unchanged (exit 0 all
match, 1 a mismatch or a file without checksums, 2 bad input)."""

from __future__ import annotations

import json
from pathlib import Path

from tpsim.offline.verify import check_index, files_of, verify_file


def cmd_verify(args) -> int:
    targets = [Path(p) for p in args.paths]
    report = {}
    for t in targets:
        for f in files_of(t):
            report[str(f)] = verify_file(f)
        if t.is_dir():
            report[str(t)] = report.get(str(t), []) + check_index(t)
    ok = not any(report.values())
    if args.json:
        print(json.dumps({"ok": ok, "files": report}, indent=2))
    else:
        for f, problems in report.items():
            if not problems and Path(f).is_file():
                print(f"ok   {f}")
            for p in problems:
                print(f"FAIL {f}: {p}")
    return 0 if ok else 1
