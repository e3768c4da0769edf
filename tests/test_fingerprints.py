"""Source fingerprints: a symbol's hash is stable (a pinned snippet, and the same hash whatever comments,
docstrings, blank lines or line numbers surround the code), each release of every line is classified
READ/SAME/CHANGED/ABSENT/UNKNOWN, every cited symbol has its fingerprint at the release it was read at, and
a replay at a changed release says UNVERIFIED through the real CLI (text and --json)."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clirun import ROOT, cli_env, run_cli
from tpsim.profiles import fingerprints, registry
from tpsim.profiles.fingerprints import (ABSENT, Key, Status, Table, builtin_table, classify, classify_line,
                                         fingerprint, line_releases, read_release, release_named)
from tpsim.profiles.cited import Source


@functools.lru_cache(maxsize=None)
def tool():
    """tools/fingerprint.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("fingerprint_tool", ROOT / "tools" / "fingerprint.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# --- the fingerprint of a symbol ------------------------------------------------------------

PINNED = '''
class Model:
    """A model."""

    LIMIT = 3

    def forward(self, hidden_states, residual, layers):
        aux = []
        for i in range(len(layers)):
            if i in self.layers_to_capture:  # before layer i
                aux.append(hidden_states + residual)
            hidden_states, residual = layers[i](hidden_states, residual)
        return hidden_states, aux
'''


def test_a_pinned_snippet_has_a_pinned_hash():
    """The hash of this literal code: a change to the normalisation changes every committed hash, so it
    must show here first (and then the table is regenerated)."""
    assert fingerprint(PINNED, "Model.forward") == "fa1ee1df8e2917a5"
    assert fingerprint(PINNED, "Model") == "efca0c49d1e4c547"
    assert fingerprint(PINNED, "Model.LIMIT") == "7819dc856d5e656e"


def test_docstrings_comments_and_line_numbers_do_not_count_code_does():
    moved = "\n\n# a header comment\n" + PINNED.replace(
        "    def forward(self, hidden_states, residual, layers):\n",
        "    def forward(self, hidden_states, residual, layers):\n        '''Capture before each layer.'''\n\n")
    moved = moved.replace("  # before layer i", "  # the capture set")
    assert fingerprint(moved, "Model.forward") == fingerprint(PINNED, "Model.forward")
    plus_one = PINNED.replace("if i in self.layers_to_capture", "if i + 1 in self.layers_to_capture")
    assert fingerprint(plus_one, "Model.forward") != fingerprint(PINNED, "Model.forward")
    swapped = PINNED.replace("hidden_states + residual", "residual + hidden_states")
    assert fingerprint(swapped, "Model.forward") != fingerprint(PINNED, "Model.forward")


def test_symbols_are_found_by_qualified_name():
    code = textwrap.dedent('''
        X = 1
        if True:
            def g():
                return 1
        else:
            def g():
                return 2
        class A:
            def b(self):
                return 1
            def b(self):
                return 2
    ''')
    assert fingerprint(code, "A.b") == fingerprint("class A:\n    def b(self):\n        return 2\n", "A.b")
    assert fingerprint(code, "X") is not None and fingerprint(code, "g") is not None
    assert fingerprint(code, "A.c") is None and fingerprint(code, "B") is None and fingerprint(code, "X.y") is None


IDENT = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True).filter(lambda s: s not in {
    "if", "in", "is", "or", "and", "not", "for", "def", "del", "try", "as", "with", "else", "elif", "pass",
    "from", "None", "True", "None", "while", "yield", "class", "break", "raise", "async", "await", "global",
    "lambda", "return", "assert", "except", "import", "finally", "continue", "nonlocal"})
STATEMENT = st.one_of(
    st.builds(lambda a, b, n: f"{a} = {b} + {n}", IDENT, IDENT, st.integers(0, 99)),
    st.builds(lambda a, b: f"if {a} in {b}:\n    {a} = [{b}]", IDENT, IDENT),
    st.builds(lambda a, n: f"for {a} in range({n}):\n    pass", IDENT, st.integers(0, 9)),
    st.builds(lambda a: f"return {a}", IDENT),
)


@given(name=IDENT, body=st.lists(STATEMENT, min_size=1, max_size=6), lead=st.integers(0, 5),
       comments=st.lists(st.tuples(st.integers(0, 40), st.sampled_from(["# why", "#", "# x = 1", ""])), max_size=5),
       doc=st.sampled_from(["", '"""Doc."""', "'''Two\n    lines.'''"]))
def test_the_hash_ignores_inserted_comments_blank_lines_and_docstrings(name, body, lead, comments, doc):
    """Over drawn functions: whatever comment or blank lines are inserted, a docstring added, and however far
    down the file the function sits, the hash is the one of the bare code."""
    lines = [f"def {name}():"] + ["    " + ln for stmt in body for ln in stmt.split("\n")]
    bare = "\n".join(lines) + "\n"
    noisy = list(lines)
    for at, text in sorted(comments, reverse=True):
        noisy.insert(1 + at % len(lines), ("    " + text) if text else "")
    if doc:
        noisy.insert(1, "    " + doc)
    assert fingerprint("\n" * lead + "\n".join(noisy) + "\n", name) == fingerprint(bare, name)


# --- classifying ----------------------------------------------------------------------------

REPO, PATH, SYM = "sgl-project/sglang", "python/sglang/srt/models/deepseek_v2.py", "DeepseekV2Model.forward"
KEY = Key(REPO, PATH, SYM)
SMALL = Table({KEY: {"0.5.6": "aaaa", "0.5.7": "aaaa", "0.5.13": "bbbb", "0.5.14": ABSENT}})


@pytest.mark.parametrize("release, ref, want", [
    ("0.5.6", "v0.5.6", Status.READ),
    ("0.5.7", "v0.5.6", Status.SAME),
    ("0.5.13", "v0.5.6", Status.CHANGED),
    ("0.5.6", "v0.5.13", Status.CHANGED),  # older code than the code read counts too
    ("0.5.14", "v0.5.6", Status.ABSENT),
    ("0.5.12", "v0.5.6", Status.UNKNOWN),  # no fingerprint of that release
    ("0.5.7", "00239548f1cd1a06ca145a5447a86738090a48f1", Status.UNKNOWN),  # read at a commit: nothing to compare
    ("0.5.13", "v0.5.12", Status.UNKNOWN),  # the release read has no fingerprint
])
def test_a_release_is_classified_against_the_release_read(release, ref, want):
    v = classify(Source(REPO, PATH, ref, symbol=SYM), release, SMALL)
    assert v.status is want and v.release == release
    assert v.read == (None if "." not in ref else ref[1:])


@pytest.mark.parametrize("release, reviewed, want", [
    ("0.5.13", ("v0.5.13",), Status.READ),  # the changed code was read there too
    ("0.5.13", (), Status.CHANGED),
    ("0.5.12", ("0.5.13",), Status.UNKNOWN),
])
def test_a_changed_release_that_was_read_counts_as_read(release, reviewed, want):
    """`Source.reviewed`: releases whose changed code was read too (the behaviour holds there); a later
    release with the same code as one of them is SAME, not CHANGED."""
    v = classify(Source(REPO, PATH, "v0.5.6", symbol=SYM, reviewed=reviewed), release, SMALL)
    assert v.status is want
    later = Table({KEY: {**SMALL.hashes[KEY], "0.5.15": "bbbb"}})
    assert classify(Source(REPO, PATH, "v0.5.6", symbol=SYM, reviewed=("0.5.13",)), "0.5.15", later).status \
        is Status.SAME
    assert classify(Source(REPO, PATH, "v0.5.6", symbol=SYM), "0.5.15", later).status is Status.CHANGED


def test_the_table_round_trips_and_refuses_a_bad_file():
    assert Table.parse(SMALL.dump(), "t").hashes == SMALL.hashes
    with pytest.raises(ValueError, match="header"):
        Table.parse("release\thash\n", "t")
    with pytest.raises(ValueError, match=":2: 3 columns"):
        Table.parse("\t".join(fingerprints.HEADER) + "\na\tb\tc\n", "t")


@pytest.mark.parametrize("line", registry.LINES, ids=lambda ln: f"{ln.engine}:{ln.family}")
def test_every_release_in_every_line_is_classified(line):
    """Each release of the line's range gets one class, under the profile in force there, with the
    committed table; the releases are the engine's from the line's first profiled one on."""
    got = classify_line(line)
    assert [c.release for c in got] == line_releases(line)
    for c in got:
        assert c.status in Status and c.profile.engine == line.engine
        assert {v.source for v in c.verdicts} == {s for s in c.profile.sources() if s.symbol}
    if line.engine in registry.RELEASES:
        assert got[-1].release == max(registry.RELEASES[line.engine], key=registry.version_key)


def test_every_cited_symbol_has_its_fingerprint_at_the_release_read():
    """Every source that names a symbol and was read at a release of a package the tool fetches has a hash
    there (not `absent`: the symbol cited must exist in the code read). Not vacuous: the symbols the tool's
    EXTRA list names are in the table at every release of their engine's lines (SGLang 0.5.6 .. 0.5.23,
    vLLM 0.18.0 .. 0.33.0), and exist at the newest."""
    t, fp = builtin_table(), tool()
    missing = [f"{s} {s.symbol}" for _, s in fp.cited_sources(registry.LINES)
               if s.symbol and s.repo in fp.PACKAGES and read_release(s)
               and t.at(Key.of(s), read_release(s)) in (None, ABSENT)]
    assert not missing, f"run tools/fingerprint.py (docs/profiles.md) for: {missing}"
    want = fp.targets(list(fp.EXTRA))
    assert {k.repo for k in fp.EXTRA} == {"sgl-project/sglang", "vllm-project/vllm"}
    for key in fp.EXTRA:
        assert {"0.5.6", "0.5.23"} <= want[key] or {"0.18.0", "0.33.0"} <= want[key], key
        gaps = sorted(r for r in want[key] if t.at(key, r) is None)
        assert not gaps, f"{key.short} has no fingerprint at {gaps}: run tools/fingerprint.py --extra"
    assert t.at(Key(REPO, PATH, SYM), "0.5.20") not in (None, ABSENT)


def test_the_unverified_line_names_each_symbol_once_with_the_newest_release_read():
    def v(ref: str, status: Status, symbol: str = SYM) -> fingerprints.Verdict:
        s = Source(REPO, PATH, ref, symbol=symbol)
        return fingerprints.Verdict(s, "0.5.20", status, read_release(s))
    u = fingerprints.Unverified("sglang", "latest", "0.5.20", (
        v("v0.5.17", Status.CHANGED), v("v0.5.6", Status.CHANGED), v("v0.5.23", Status.CHANGED, "DeepseekV2Model"),
        v("3e4a39ee", Status.ABSENT, "DeepseekV2Model.tbo")))
    # issue 52 item 5: in a user's words (the behaviour, the file, how to check), no private symbol
    assert u.line == (f"UNVERIFIED: sglang@0.5.20 (latest) runs code tpsim did not read for a cited behaviour: {PATH} "
                      "lacks the code read at 3e4a39ee; "
                      f"a cited behaviour: {PATH} changed after 0.5.17, the release read; "
                      f"a cited behaviour: {PATH} changed before 0.5.23, the release read "
                      "(to check: read those files at 0.5.20, or name a release read)")
    assert "DeepseekV2Model" not in u.line
    assert u.to_dict()["line"] == u.line and len(u.to_dict()["sources"]) == 4


def test_a_server_version_names_a_release():
    newest = max(registry.RELEASES["sglang"], key=registry.version_key)
    assert release_named("sglang", "latest") == newest and release_named("sglang", "0.5.20") == "0.5.20"
    assert release_named("sglang", "2026-09-01") is None and release_named("eagle", "latest") is None


# --- through the real CLI -------------------------------------------------------------------

# The profile data names no symbol yet in some checkouts: this prelude gives every source of SGLang's
# deepseek_v2.py the symbol DeepseekV2Model.forward and a quote, points tpsim at a table fixture, then runs
# the real CLI in this process.
PRELUDE = '''
import dataclasses, sys
from pathlib import Path
from tpsim.profiles import fingerprints, registry
from tpsim.profiles.profile import Behaviour, Cited

fingerprints.TABLE_PATH = Path(sys.argv[1])
def marked(c):
    if c is None or not c.source.path.endswith("sglang/srt/models/deepseek_v2.py"):
        return c
    return Cited(c.value, dataclasses.replace(c.source, symbol="DeepseekV2Model.forward",
                                              quote="for i in range(start, end):\\n    if i in self.layers_to_capture:"))
def line(ln):
    if ln.engine != "sglang" or ln.family != "deepseek_v2":
        return ln
    base = Behaviour(**{f: marked(getattr(ln.base, f)) for f in Behaviour.FIELDS})
    changes = tuple(dataclasses.replace(c, changes={k: marked(v) for k, v in c.changes.items()}) for c in ln.changes)
    return dataclasses.replace(ln, base=base, changes=changes)
registry.LINES = tuple(map(line, registry.LINES))
from tpsim.cli.main import main
raise SystemExit(main(sys.argv[2:]))
'''


@pytest.fixture(scope="module")
def changed_at_0520(tmp_path_factory) -> Path:
    """A table where DeepseekV2Model.forward is one code up to 0.5.19 and another from 0.5.20 on."""
    releases = line_releases(next(ln for ln in registry.LINES if (ln.engine, ln.family) == ("sglang", "deepseek_v2")))
    late = registry.version_key("0.5.20")
    table = Table({KEY: {r: "bbbb" if registry.version_key(r) >= late else "aaaa" for r in releases}})
    path = tmp_path_factory.mktemp("fp") / "fingerprints.tsv"
    path.write_text(table.dump())
    return path


def patched_cli(table: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE, str(table), *argv], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=600)


UNVERIFIED = ("UNVERIFIED: sglang@0.5.20 runs code tpsim did not read for what an embedding id captures and where in "
              f"the layer the capture is taken and whether the capture is copied and how a token-scattered stream is "
              f"gathered: {PATH} changed after 0.5.14, the release read (to check: read those files at 0.5.20, or "
              "name a release read)")


def test_a_replay_at_a_changed_release_says_unverified(changed_at_0520):
    r = patched_cli(changed_at_0520, "check", "--server", "sglang@0.5.20", "--tp", "1")
    assert r.returncode == 0 and [ln for ln in r.stdout.splitlines() if ln.startswith("UNVERIFIED")] == [UNVERIFIED], \
        r.stdout + r.stderr
    r = patched_cli(changed_at_0520, "check", "--server", "sglang@0.5.19", "--tp", "1")
    assert r.returncode == 0 and "UNVERIFIED" not in r.stdout, r.stdout + r.stderr
    r = patched_cli(changed_at_0520, "resolve", "--server", "sglang@0.5.20", "--num-layers", "61", "--json")
    got = json.loads(r.stdout)["unverified"]
    assert got["line"] == UNVERIFIED and got["release"] == "0.5.20"
    assert {s["status"] for s in got["sources"]} == {"changed"} and {s["read"] for s in got["sources"]} >= {"0.5.14"}


def test_profiles_json_carries_the_classes_and_the_quotes():
    """The real data: every SGLang and vLLM behaviour names its symbol and quotes it; `--json` classifies each
    release (the releases a source was read at are `read`); `--sources` prints the quotes."""
    r = run_cli("profiles", "--json")
    assert r.returncode == 0, r.stderr
    engines = [p for p in json.loads(r.stdout) if p["engine"] in ("sglang", "vllm")]
    assert engines and all(b["symbol"] and b["quote"] for p in engines for b in p["behaviour"].values()
                           if b is not None and b.get("source")), "a source without its symbol or quote"
    statuses = {c["status"] for p in json.loads(r.stdout) for c in p["releases"]}
    assert statuses <= {s.name.lower() for s in Status} and "read" in statuses
    r = run_cli("profiles", "--sources")
    assert "      | " in r.stdout and "DeepseekV2Model.forward" in r.stdout


def test_profiles_lists_every_line_with_its_releases_classified():
    r = run_cli("profiles", "--json")
    profiles = json.loads(r.stdout)
    for line in registry.LINES:
        mine = [c for p in profiles if (p["engine"], p["family"]) == (line.engine, line.family) for c in p["releases"]]
        assert sorted(c["release"] for c in mine) == sorted(line_releases(line))
    assert all("quote" in b and "symbol" in b for p in profiles for b in p["behaviour"].values())
    r = run_cli("profiles")
    assert "sglang:deepseek_v2: " in r.stdout and "vllm:llama: " in r.stdout


# --- the tool's bad input (nothing downloaded) ----------------------------------------------

@pytest.mark.parametrize("argv, expect", [
    (["--symbol", "nowhere.py"], "want PATH::SYMBOL"),
    (["--from", "zero"], "--from 'zero' is not a version"),
    (["--package", "torch"], "invalid choice"),
])
def test_the_tool_refuses_bad_input_in_one_line(tmp_path, argv, expect):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "fingerprint.py"), "--cache", str(tmp_path), *argv,
                        "--out", str(tmp_path / "t.tsv")], cwd=ROOT, env=cli_env(), capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and expect in r.stderr.splitlines()[-1], r.stderr
    assert not (tmp_path / "t.tsv").exists()
