"""Every fix triage prints has been replayed: the property, checked from outside. For drawn draft
configs, engine profiles and served flags, each fix marked replayed is applied as a user would apply it
(the JSON fragment the fix says to write, merged into the draft config; the engine version it names; capture
turned on; no pipeline stages) and triage run again: the finding is gone and no finding of a new kind appears."""

from __future__ import annotations

import json
import re

from hypothesis import example, given, settings, strategies as st

from clirun import run_cli

SERVERS = ["sglang@0.5.6", "sglang@0.5.10", "sglang@0.5.12", "sglang@0.5.12:deepseek_v3", "sglang@0.5.14",
           "sglang@0.5.23", "vllm@0.25.0", "vllm"]
KEY = "eagle_aux_hidden_state_layer_ids"


def triage(raw: dict, tmp, server: str, flags: list[str]) -> tuple[int, dict]:
    path = tmp / f"config-{abs(hash(json.dumps(raw, sort_keys=True)))}.json"
    path.write_text(json.dumps(raw))
    r = run_cli("triage", "--draft-config", str(path), "--server", server, *flags, "--json")
    assert r.returncode in (0, 1), r
    return r.returncode, json.loads(r.stdout)


def merged(raw: dict, fragment: dict) -> dict:
    out = json.loads(json.dumps(raw))
    for k, v in fragment.items():
        out[k] = merged(out.get(k) if isinstance(out.get(k), dict) else {}, v) if isinstance(v, dict) else v
    return out


def applied(raw: dict, fix: str, change: dict) -> dict:
    """The draft config after the user follows `fix` (its `write {...}` fragment, its capture switch)."""
    out = json.loads(json.dumps(raw))
    if change["capture_on"]:
        out.get("eagle_config", {}).pop("use_aux_hidden_state", None)
    m = re.search(r"write (.+?) in the draft config", fix)
    return merged(out, json.loads("{" + m.group(1) + "}")) if m else out


@settings(max_examples=8, deadline=None)
@given(ids=st.lists(st.integers(-1, 8), min_size=3, max_size=3), nested=st.booleans(),
       off=st.booleans(), server=st.sampled_from(SERVERS), tp=st.sampled_from(["2", "8"]))
@example(ids=[-1, 3, 5], nested=True, off=False, server="sglang@0.5.12", tp="2")
@example(ids=[1, 3, 5], nested=False, off=False, server="sglang@0.5.12:deepseek_v3", tp="8")
def test_every_printed_fix_clears_its_finding_and_opens_none(tmp_path_factory, ids, nested, off, server, tp):
    tmp = tmp_path_factory.mktemp("fixes")
    raw = {"eagle_config": {KEY: ids}} if nested else {KEY: ids}
    if off:
        raw.setdefault("eagle_config", {})["use_aux_hidden_state"] = False
    flags = ["--tp", tp]
    code, rep = triage(raw, tmp, server, flags)
    kinds = {f["kind"] for f in rep["findings"]}
    for f in rep["findings"]:
        assert ("fix replayed" not in f["fix"]) and (f["fix_replayed"] == (f["change"] is not None))
        if not f["fix_replayed"]:
            assert f["fix"].startswith("none that tpsim replayed clears it"), f
            continue
        change = f["change"]
        _, after = triage(applied(raw, f["fix"], change), tmp, change["server"] or server, flags)
        now = {g["kind"] for g in after["findings"]}
        assert f["kind"] not in now and now <= kinds, (f, after["findings"])


@settings(max_examples=4, deadline=None)  # each draw: two triages with replays (~5-20 s)
@given(ids=st.lists(st.integers(-1, 8), min_size=3, max_size=3), nested=st.booleans(),
       off=st.booleans(), server=st.sampled_from(SERVERS), tp=st.sampled_from(["2", "8"]),
       train=st.sampled_from([None, "specforge-ids:1,3,5", "specforge-ids:2,4,6"]))
@example(ids=[-1, 3, 5], nested=True, off=False, server="sglang@0.5.12:deepseek_v3", tp="8",
         train="specforge-ids:1,3,5")  # the README's story on the tiny target: a crash, an edit, the served mode
@example(ids=[2, 4, 6], nested=True, off=False, server="sglang@0.5.14", tp="2", train="specforge-ids:1,3,5")
@example(ids=[1, 3, 5], nested=True, off=True, server="vllm@0.25.0", tp="2", train=None)
def test_a_printed_plan_applied_as_a_user_would_gives_exit_0(tmp_path_factory, ids, nested, off, server, tp, train):
    """Issue 52: triage's PLAN, every change at once as the user applies it, is replayed as a whole: where it says
    it clears everything, triage on the changed config and engine exits 0; where not, exactly what it says remains."""
    tmp = tmp_path_factory.mktemp("plan")
    raw = {"eagle_config": {KEY: ids}} if nested else {KEY: ids}
    if off:
        raw.setdefault("eagle_config", {})["use_aux_hidden_state"] = False
    flags = ["--tp", tp, *(["--train", train] if train else [])]
    code, rep = triage(raw, tmp, server, flags)
    plan = rep["plan"]
    if code == 0 or plan is None:
        assert code == 0 or not any(f["fix_replayed"] for f in rep["findings"]), rep["findings"]
        return
    change = plan["change"]
    after_code, after = triage(applied(raw, plan["text"], change), tmp, change["server"] or server, flags)
    if plan["clears"]:
        assert after_code == 0, (plan, after["findings"])
    else:
        assert sorted(f["kind"] for f in after["findings"]) == sorted(plan["remaining"]), (plan, after["findings"])
