"""`tpsim acceptance --returned-hidden-states OUT.safetensors`: the hidden states SGLang's `return_hidden_states`
gives back for each measured sequence, as the served version returns them under speculative decoding
(tpsim.profiles.returned), written as tpsim capture files (`OUT.seq{i}.safetensors`) that `tpsim diagnose` reads:
the rows returned, the token ids the request holds, the positions captured."""

from __future__ import annotations

from pathlib import Path

import torch

from tpsim.app.acceptance import AcceptanceReport
from tpsim.base.errors import UsageError
from tpsim.capture.files import write_capture
from tpsim.profiles.history import Held
from tpsim.profiles.returned import Returned


def returned_paths(out: Path, n: int) -> list[Path]:
    return [out.with_name(f"{out.stem}.seq{i}{out.suffix}") for i in range(n)]


def write_returned(report: AcceptanceReport, held: Held[Returned], out: Path) -> list[Path]:
    """One file per sequence: the served capture's rows at the positions `held` returns, for the tokens the
    request holds after its last round (prompt + every emitted token)."""
    served = report.served
    if served.acceptance is None:
        raise UsageError(f"--returned-hidden-states: {served.fed.failure}; the server returns no aux hidden states "
                         "to write")
    cfg = report.inputs.target.source.cfg
    meta = {"positions": ",".join(map(str, served.fed.positions)), "num_layers": str(cfg.num_hidden_layers),
            "returned_by": f"{held.server}: {held.value.value} ({held.cited.source})", "tp": str(served.fed.tp)}
    paths = returned_paths(out, len(report.sequences))
    for path, seq, accepted, capture in zip(paths, report.sequences, served.rounds, served.captures):
        rows = held.value.positions(seq.prompt, accepted)
        end = seq.prompt + sum(a + 1 for a in accepted)
        write_capture(path, capture[rows].to(torch.float32).cpu().contiguous(), list(seq.tokens[:end]),
                      {**meta, "rows": str(len(rows)), "tokens": str(end)})
    return paths
