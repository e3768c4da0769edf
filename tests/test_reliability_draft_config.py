"""A draft's config.json, read by `tpsim draft`, `acceptance`, `triage` and `align`: every key tpsim or an engine reads
is checked for type and range in one place (tpsim.draft.config.check_keys / DraftConfig.from_json). Bad input is one
line `tpsim: error: ...` naming the key, the value and the fix, exit 2, nothing written, before any rank starts; a
string where a boolean goes is refused, never read as true; ids past the target's layers are a finding where the
target is known. Every valid config still loads, in SpecForge's layout and the speculators one."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from clirun import ROOT, assert_one_line_error, run_cli
from test_draft_checkpoint import CONFIG
from test_draft_config_alone import alone, expand
from tpsim.app.draft_engines import every_release, ids_findings, releases
from tpsim.base.errors import UsageError
from tpsim.draft.config import DraftConfig
from tpsim.draft.findings import DraftDefect
from tpsim.offline.align import read_draft_config
from tpsim.profiles import registry
from tpsim.profiles.loader_lines import LINES, lookup

SMOLLM2_DRAFT = ROOT / "configs" / "drafts" / "smollm2-135m-eagle3"
LAYERS = 30  # SmolLM2-135M's
IDS = "eagle_aux_hidden_state_layer_ids"
REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
INTS = (*REQUIRED, "num_key_value_heads", "head_dim", "draft_vocab_size", "target_hidden_size", "num_aux_hidden_states")
FLOATS = ("rms_norm_eps", "rope_theta")
BOOLS = ("fc_norm", "norm_before_fc", "norm_before_residual", "norm_output", "eagle_config.norm_before_fc",
         "eagle_config.use_aux_hidden_state")
ID_KEYS = (f"eagle_config.{IDS}", IDS, "dflash_config.target_layer_ids", "dspark_target_layer_ids", "target_layer_ids",
           "dflash_config.layer_ids", "eagle_config.layer_ids")
MAPPINGS = ("rope_scaling", "eagle_config", "rope_parameters")
# each DraftConfig field and the config.json key it is read from: a field added without a key here fails
# test_every_field_is_drawn_bad
FIELD_KEYS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
              "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
              "head_dim": "head_dim", "vocab_size": "vocab_size", "draft_vocab_size": "draft_vocab_size",
              "target_hidden_size": "target_hidden_size", "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
              "rope_scaling": "rope_scaling", "num_aux": "num_aux_hidden_states", "fc_norm": "fc_norm",
              "norm_before_fc": "norm_before_fc", "norm_before_residual": "norm_before_residual",
              "norm_output": "norm_output", "aux_layer_ids": f"eagle_config.{IDS}",
              "nested_norm_before_fc": "eagle_config.norm_before_fc",
              "use_aux_hidden_state": "eagle_config.use_aux_hidden_state"}
# the keys the speculators format keeps in transformer_layer_config (speculators 0.9.0 save_pretrained)
LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}


def put(raw: dict, key: str, value, layout: str) -> dict:
    """`raw` with `key` ("a.b": b inside a) set to `value`, where `layout` keeps it."""
    if layout == "speculators" and key in LAYER_KEYS:
        raw = raw["transformer_layer_config"]
    *outer, last = key.split(".")
    for k in outer:
        if not isinstance(raw.get(k), dict):
            raw[k] = {}
        raw = raw[k]
    raw[last] = value
    return raw


def laid_out(flat: dict, layout: str) -> dict:
    """`flat` (SpecForge's keys) as `layout` writes it: the speculators format nests the layer's keys."""
    if layout == "specforge":
        return flat
    layer = {k: v for k, v in flat.items() if k in LAYER_KEYS}
    return {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
            "speculators_config": {"algorithm": "eagle3", "verifier": {"architectures": ["LlamaForCausalLM"]}},
            "transformer_layer_config": layer, **{k: v for k, v in flat.items() if k not in LAYER_KEYS}}


def nested(depth: int, inner=1):
    for i in range(depth):
        inner = {"a": inner} if i % 2 else [inner]
    return inner


# --- bad values, per kind of key ----------------------------------------------------------------

NOT_A_NUMBER = st.one_of(st.text(max_size=8), st.booleans(), st.lists(st.integers(), max_size=2), st.just({}))
NOT_A_BOOLEAN = st.one_of(st.sampled_from(["false", "true", "False", "yes", "no", "0", ""]), st.text(max_size=8),
                          st.integers(), st.floats(), st.lists(st.booleans(), max_size=2), st.just({}))


def bad_ints(key: str):
    """Zero or negative, not an integer (a float, inf, NaN, a string, a boolean, a list), too big to build, null
    where the key is required."""
    huge = st.integers(2**60, 2**80) if key != "num_aux_hidden_states" else st.integers(257, 2**80)
    return st.one_of(st.integers(max_value=0), st.floats(), NOT_A_NUMBER, huge,
                     *([st.none()] if key in REQUIRED else []))


def bad_floats(key: str):
    """Not finite, not a number, or out of range (eps negative, rope_theta zero or negative)."""
    low = st.floats(max_value=-1e-300, allow_nan=False) if key == "rms_norm_eps" else st.floats(max_value=0,
                                                                                                 allow_nan=False)
    return st.one_of(low, st.sampled_from([math.nan, math.inf, -math.inf]), NOT_A_NUMBER)


def bad_ids():
    """Not a list of integers (a float, string, boolean or list among them; a scalar; a mapping), or too many."""
    odd = st.one_of(st.floats(), st.text(max_size=3), st.booleans(), st.lists(st.integers(), max_size=1))
    some_bad = st.tuples(st.lists(st.integers(-1, 60), max_size=3), odd, st.integers(0, 3)).map(
        lambda t: t[0][:t[2]] + [t[1]] + t[0][t[2]:])
    return st.one_of(some_bad, st.text(max_size=4), st.integers(), st.floats(), st.just({}), st.just([2] * 300))


BAD_ROPE_SCALING = st.one_of(
    st.lists(st.integers(), max_size=2), st.text(max_size=5), st.integers(), st.booleans(),
    st.sampled_from([{"rope_type": "dynamic", "factor": 2.0}, {"type": "linear", "factor": 2.0}, {"rope_type": "mrope"},
                     {"rope_type": None}, {"rope_type": "llama3"}, {**LLAMA3, "factor": 0}, {**YARN, "factor": "4"},
                     {**LLAMA3, "high_freq_factor": 0.5}, {**YARN, "beta_fast": math.nan},
                     {**YARN, "truncate": "false"}]))


def bad_values(key: str):
    if key in INTS:
        return bad_ints(key)
    if key in FLOATS:
        return bad_floats(key)
    if key in BOOLS:
        return NOT_A_BOOLEAN
    if key in ID_KEYS:
        return bad_ids()
    if key == "rope_scaling":
        return BAD_ROPE_SCALING
    return st.one_of(st.lists(st.integers(), max_size=2), st.text(max_size=4), st.integers(), st.booleans())


EVERY_KEY = (*INTS, *FLOATS, *BOOLS, *ID_KEYS, *MAPPINGS)


@st.composite
def bad_cases(draw) -> tuple[str, object]:
    """(key, a bad value for it): of its kind, or JSON nested past any draft config's depth."""
    key = draw(st.sampled_from(EVERY_KEY))
    if draw(st.integers(0, 9)) == 0:
        return key, nested(draw(st.integers(17, 60)))
    return key, draw(bad_values(key))


def mentions(message: str, value) -> bool:
    """The message quotes `value` (as repr, JSON or %g); a container or a long or spaced string may be cut."""
    if isinstance(value, (list, dict)) or (isinstance(value, str) and (len(value) > 60 or value != value.strip()
                                                                       or any(c.isspace() for c in value))):
        return True
    if isinstance(value, float):
        return repr(value) in message or f"{value:g}" in message or json.dumps(value) in message
    return repr(value) in message or json.dumps(value) in message or str(value) in message


def base(layout: str) -> dict:
    return laid_out(json.loads(json.dumps(CONFIG)), layout)


REPRODUCED = [  # issue 55: each a traceback or accepted silently on main
    ("hidden_size", 0), ("hidden_size", -4096), ("hidden_size", 4096.5), ("hidden_size", "4096"), ("hidden_size", True),
    ("hidden_size", 2**70), ("hidden_size", math.inf), ("draft_vocab_size", -1), ("draft_vocab_size", 32000.0),
    ("num_key_value_heads", 0), ("rope_theta", "10000"), ("num_aux_hidden_states", -1), ("num_aux_hidden_states", "3"),
    ("target_hidden_size", -1), ("target_hidden_size", "4096"), ("rope_scaling", [8.0]),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}), ("rope_scaling", nested(40)),
    ("head_dim", 0), ("rms_norm_eps", -1e-5), ("rms_norm_eps", math.nan), ("rope_theta", 0),
    ("num_aux_hidden_states", 0), (f"eagle_config.{IDS}", [1.0, 14, 26]),
    ("eagle_config.use_aux_hidden_state", "false"), ("norm_output", "yes"), ("norm_output", "false"),
    ("target_hidden_size", 0),
]


def _with_examples(test):
    for key, value in REPRODUCED:
        test = example(case=(key, value), layout="specforge")(test)
    return example(case=("hidden_size", 0), layout="speculators")(test)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=bad_cases(), layout=st.sampled_from(["specforge", "speculators"]))
@_with_examples
def test_a_bad_value_is_one_line_naming_the_key_the_value_and_the_fix(case, layout):
    """Guards the promise in process: any bad value at any key DraftConfig reads (wrong type, zero or negative,
    too big to build, non-finite, a string for a boolean, nesting) raises UsageError, one line, naming the key
    (as the layout spells it) and the value, with a fix after `; `."""
    key, value = case
    raw = base(layout)
    put(raw, key, value, layout)
    with pytest.raises(UsageError) as e:
        DraftConfig.from_json(raw, "draft/config.json")
    message = str(e.value)
    assert "\n" not in message and message.startswith("draft/config.json"), message
    assert key.split(".")[-1] in message or (key.split(".")[0] in message and "nested too deeply" in message), message
    assert "; " in message, message
    assert mentions(message, value), message


@settings(max_examples=20, deadline=None)
@given(case=bad_cases())
@example(case=("eagle_config.use_aux_hidden_state", "false"))
@example(case=("norm_output", "false"))
@example(case=("rope_theta", "10000"))
def test_align_and_triage_refuse_what_the_draft_refuses(case, tmp_path_factory):
    """Guards the one validation layer: --draft-config (align, triage, acceptance's ids) refuses a bad value at a key
    it holds with the same words as `tpsim draft` (a config of ids alone is still read)."""
    key, value = case
    raw = {"eagle_config": {IDS: [1, 14, 26]}}
    put(raw, key, value, "specforge")
    path = tmp_path_factory.mktemp("c") / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(UsageError) as e:
        read_draft_config(str(path))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"--draft-config {path}"), message
    with pytest.raises(UsageError) as full:
        DraftConfig.from_json({**CONFIG, **raw}, "x")
    assert message.split(": ", 1)[1] == str(full.value).split(": ", 1)[1]


def test_every_field_is_drawn_bad():
    """Guards `every field checked`: each DraftConfig field maps to a config key the bad-value property draws."""
    assert {f.name for f in dataclasses.fields(DraftConfig)} == set(FIELD_KEYS)
    assert set(FIELD_KEYS.values()) <= set(EVERY_KEY)


# --- valid configs ---------------------------------------------------------------------------------

OPTIONAL = ("num_key_value_heads", "head_dim", "draft_vocab_size", "target_hidden_size", "num_aux_hidden_states",
            "rms_norm_eps", "rope_theta", "rope_scaling", "fc_norm", "norm_before_fc", "norm_before_residual",
            "norm_output", "eagle_config")


@st.composite
def valid_configs(draw) -> tuple[dict, dict]:
    """(a valid draft config.json, the flat keys drawn): sizes that build, optional keys absent, null or set."""
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.integers(1, 4))
    d = 2 * draw(st.integers(1, 8))
    given = draw(st.booleans())
    keys = {"hidden_size": draw(st.integers(1, 64)) if given else heads * d,
            "intermediate_size": draw(st.integers(1, 64)), "num_attention_heads": heads,
            "vocab_size": draw(st.integers(1, 300))}
    choices = {"num_key_value_heads": st.just(kv), "head_dim": st.just(d) if given else st.none(),
               "draft_vocab_size": st.integers(1, 300), "target_hidden_size": st.integers(1, 64),
               "num_aux_hidden_states": st.integers(1, 8), "rms_norm_eps": st.floats(0, 1e-2),
               "rope_theta": st.floats(2, 1e7), "norm_output": st.booleans(), "fc_norm": st.booleans(),
               "norm_before_fc": st.booleans(), "norm_before_residual": st.booleans(),
               "rope_scaling": st.sampled_from([LLAMA3, YARN, {"rope_type": "default"}, {"type": "yarn", "factor": 2,
                                                "original_max_position_embeddings": 64}]),
               "eagle_config": st.fixed_dictionaries({}, optional={
                   IDS: st.lists(st.integers(-1, 60), min_size=1, max_size=5), "norm_before_fc": st.booleans(),
                   "use_aux_hidden_state": st.booleans()})}
    for key in OPTIONAL:
        how = "given" if key == "head_dim" and given else draw(st.sampled_from(["absent", "null", "set"]))
        if how != "absent":
            keys[key] = None if how == "null" else draw(choices[key])
    if draw(st.booleans()):
        keys[IDS] = draw(st.lists(st.integers(-1, 60), min_size=1, max_size=5))
    return laid_out(json.loads(json.dumps(keys)), draw(st.sampled_from(["specforge", "speculators"]))), keys


@settings(max_examples=30, deadline=None)
@given(drawn=valid_configs())
@example(drawn=(json.loads((SMOLLM2_DRAFT / "config.json").read_text()),
                json.loads((SMOLLM2_DRAFT / "config.json").read_text())))
@example(drawn=(CONFIG, CONFIG))
def test_every_valid_config_loads_as_written(drawn):
    """Guards against refusing good input and against misreading it: a valid config (either layout, optional keys
    absent, null or set) loads, each boolean read as the JSON boolean written (absent or null: the default)."""
    raw, keys = drawn
    cfg = DraftConfig.from_json(raw, "config.json")
    heads = keys["num_attention_heads"]
    eagle = keys.get("eagle_config") or {}
    ids = eagle.get(IDS, keys.get(IDS))
    assert (cfg.hidden_size, cfg.num_attention_heads) == (keys["hidden_size"], heads)
    assert cfg.head_dim == (keys.get("head_dim") or keys["hidden_size"] // heads)
    assert cfg.num_key_value_heads == (keys.get("num_key_value_heads") or heads)
    assert cfg.target_hidden_size == (keys.get("target_hidden_size") or keys["hidden_size"])
    assert cfg.num_aux == (keys.get("num_aux_hidden_states") or (len(ids) if ids else 3))
    for flag in ("fc_norm", "norm_before_fc", "norm_before_residual", "norm_output"):
        assert getattr(cfg, flag) is (keys.get(flag) is True), flag
    assert cfg.use_aux_hidden_state is (eagle.get("use_aux_hidden_state") is not False)
    assert cfg.aux_layer_ids == (tuple(ids) if ids else None)


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "configs" / "drafts").iterdir()), ids=lambda p: p.name)
def test_the_builtin_drafts_still_read(path):
    """Guards the built-in drafts: each reads as --draft-config, and the full ones (hidden, intermediate, heads and
    vocab sizes) load as a DraftConfig."""
    read_draft_config(str(path))
    raw = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    if all(k in raw for k in REQUIRED):
        DraftConfig.from_json(raw, str(path))


# --- ids past the target's layers ---------------------------------------------------------------


def smollm2_with_ids(ids: list[int]) -> dict:
    raw = json.loads((SMOLLM2_DRAFT / "config.json").read_text())
    raw["eagle_config"][IDS] = ids
    return raw


@settings(max_examples=5, deadline=None)
@given(ids=st.lists(st.integers(0, LAYERS - 2), min_size=2, max_size=2).flatmap(
    lambda low: st.integers(LAYERS, 2 * LAYERS).map(lambda high: sorted(low) + [high])))
@example(ids=[1, 14, 40])
def test_ids_past_the_targets_layers_are_a_finding_for_every_release(ids):
    """Guards `no silent wrong answer` where the target is known (`tpsim draft --model`): ids past the target's last
    layer give every profiled release an ids finding (sglang@0.5.12 said nothing on main)."""
    ckpt = alone(smollm2_with_ids(ids))
    assert any(f.defect is DraftDefect.IDS_MISREAD and f"{LAYERS} layers" in f.cause
               for f in ids_findings(ckpt, [lookup("sglang@0.5.12")], "llama", LAYERS))
    found = every_release(ckpt, [], None, 1, "llama", LAYERS)
    named = set().union(*(expand(f.server) for f in found
                          if f.defect in (DraftDefect.IDS_MISREAD, DraftDefect.IDS_UNREAD)))
    for engine in LINES:
        for r in releases(engine):
            assert f"{engine}@{r}" in named or not _profiled(f"{engine}@{r}"), (engine, r)


def _profiled(name: str) -> bool:
    """Whether tpsim read that release's capture (else its loader's UNVERIFIED findings speak for it)."""
    try:
        registry.lookup(name, "llama")
    except UsageError:
        return False
    return True


# --- the CLI: one line, exit 2, nothing written -------------------------------------------------


def files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def draft_dir(folder: Path, raw: dict) -> Path:
    """A draft directory: `raw` as config.json beside the SmolLM2 draft's weights (linked, not copied)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    os.symlink(SMOLLM2_DRAFT / "model.safetensors", folder / "model.safetensors")
    return folder


def smollm2(**changes) -> dict:
    raw = json.loads((SMOLLM2_DRAFT / "config.json").read_text())
    return {**raw, **changes}


CLI_CASES = {  # name: (config changes, argv with {draft} / {config} / {out}, words)
    "draft-hidden-size-0": ({"hidden_size": 0}, ["draft", "{draft}"], ["field hidden_size must be positive, got 0"]),
    "draft-copy-norm-output-false": ({"norm_output": "false"}, ["draft", "{config}", "--copy", "{out}"],
                                     ["field norm_output must be true or false, got 'false'", "unquoted"]),
    "acceptance-norm-output-false": ({"norm_output": "false"}, ["acceptance", "--draft", "{draft}", "--server",
                                                                "sglang@0.5.12", "--model", "smollm2-135m"],
                                     ["field norm_output must be true or false"]),
    "acceptance-hidden-size-2**70": ({"hidden_size": 2**70}, ["acceptance", "--draft", "{draft}", "--server",
                                                              "sglang@0.5.12", "--model", "smollm2-135m"],
                                     ["field hidden_size must be at most", str(2**70)]),
    "triage-draft-rope-scaling-list": ({"rope_scaling": [8.0]}, ["triage", "--draft", "{draft}", "--server",
                                                                 "sglang@0.5.12", "--model", "smollm2-135m"],
                                       ["field rope_scaling must be a mapping, got [8.0]"]),
    "triage-config-rope-theta-string": ({"rope_theta": "1e5"}, ["triage", "--draft-config", "{config}", "--server",
                                                                "sglang@0.5.12", "--model", "smollm2-135m"],
                                        ["field rope_theta must be a number, got '1e5'"]),
    "align-num-aux-string": ({"num_aux_hidden_states": "3"}, ["align", "--draft-config", "{config}", "--server",
                                                              "sglang@0.5.12", "--num-layers", "30"],
                             ["field num_aux_hidden_states must be an integer, got '3'"]),
}


@pytest.mark.parametrize("name", CLI_CASES)
def test_the_cli_refuses_in_one_line_and_writes_nothing(tmp_path, name):
    """Guards the promise end to end: each command that reads a draft config refuses a bad one in one line (exit 2,
    no traceback, nothing on stdout), with no file written (--copy's destination included)."""
    changes, argv, words = CLI_CASES[name]
    raw = smollm2(**changes)
    folder = draft_dir(tmp_path / "draft", raw)
    given = {"draft": folder, "config": folder / "config.json", "out": tmp_path / "copy"}
    before = files(tmp_path)
    r = run_cli(*[a.format(**{k: str(v) for k, v in given.items()}) for a in argv], cwd=tmp_path)
    assert_one_line_error(r, words)
    assert files(tmp_path) == before, r


def test_deeply_nested_json_is_one_line(tmp_path):
    """Guards the parse: JSON too deep for Python's parser (a traceback from `tpsim draft` on main) is one line."""
    folder = tmp_path / "deep"
    folder.mkdir()
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    assert_one_line_error(run_cli("draft", str(folder)), ["nested too deeply"])


def test_ids_past_the_target_are_a_finding_on_the_cli(tmp_path):
    """Guards the report: `tpsim draft CONFIG --model` with ids past the target's layers exits 1 with an ids-misread
    finding (exit 0, nothing found, on main)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(smollm2_with_ids([1, 14, 40])))
    r = run_cli("draft", str(path), "--model", "smollm2-135m", "--server", "sglang@0.5.12", "--json")
    assert r.returncode == 1, r
    found = json.loads(r.stdout)["findings"]
    assert [f["defect"] for f in found] == ["ids-misread"] and "30 layers" in found[0]["cause"], r


def test_every_place_a_profile_reads_ids_from_is_checked():
    """draft/config.py keeps its own list of the id keys (it sits below profiles/ in the package order): every key
    a profile reads ids from, and every place triage looks for ids, is on it."""
    from tpsim.draft.config import ID_PATHS
    from tpsim.profiles import draft as profile_draft
    from tpsim.profiles.registry import all_profiles
    from tpsim.profiles.vllm import V2_DSPARK, V2_LAYER_IDS
    read = {k.path for p in all_profiles() for k in p.behaviour.config.value.keys}
    assert read | {k.path for k in (*V2_DSPARK, *V2_LAYER_IDS)} | set(profile_draft._ID_PLACES) <= set(ID_PATHS)
