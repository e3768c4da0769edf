"""Reliability IV (issue 55): `tpsim draft --server` lists, triage's `--train` ids, and the converted SmolLM2 cache
keep the bad-input promise (one line, exit 2, nothing run) and never hand a rank damaged data."""

from __future__ import annotations

import errno
import shutil

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from clirun import assert_one_line_error, run_cli, run_clis
from tpsim.app.asks import trained_from
from tpsim.app.draft_request import DraftRequest
from tpsim.base.errors import UsageError
from tpsim.offline.verify import verify_file
from tpsim.weights import gguf_builtin

L = 61


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-2**70, 2**70), min_size=3, max_size=3), st.sampled_from(["specforge-ids", "sglang-ids",
                                                                                       "vllm-ids"]))
@example([1, 29, 99], "specforge-ids")  # beyond the target's layers: findings, exit 1, before
@example([-2, 29, 57], "specforge-ids")  # below -1
@example([1, 29, 2**70], "specforge-ids")
def test_train_ids_no_target_layer_has_are_refused_before_anything_runs(ids, convention):
    """--train CONVENTION:IDS whose ids the convention cannot place on the target's layers is bad input (one line),
    not a triage that runs and reports findings; ids it can place are taken."""
    text = f"{convention}:{','.join(map(str, ids))}"
    reachable = {"specforge-ids": range(0, L), "sglang-ids": range(-1, L), "vllm-ids": range(0, L + 1)}[convention]
    try:
        trained = trained_from(text, "deepseek_v3", L)
    except UsageError as e:
        assert "\n" not in str(e) and str(e).startswith(f"--train {text}: ")
        assert not all(i in reachable for i in ids), e
        return
    assert all(i in reachable for i in ids) and list(trained.ids) == ids


def test_train_refusals_are_one_line_and_run_nothing():
    base = ["triage", "--draft-config", "deepseek-v3-edited-ids", "--server", "sglang@0.5.12", "--tp", "2", "--train"]
    runs = run_clis({t: [*base, t] for t in ("specforge-ids:1,29,99", "specforge-ids:1,x,3", "specforge-ids:")})
    assert_one_line_error(runs["specforge-ids:1,29,99"], ["layer id 99 is out of range", "valid 0..60"])
    for t in ("specforge-ids:1,x,3", "specforge-ids:"):  # once told to write `specforge:1,x,3`, a name it refuses
        assert_one_line_error(runs[t], ["is not a comma-separated list of integers"])


@pytest.mark.parametrize("servers, words", [
    (("sglang@0.5.12 ",), ["holding a space"]),
    (("sglang@0.5.12", "", "vllm"), ["an empty name"]),  # `--server sglang@0.5.12,,vllm`
    ((" vllm",), ["holding a space"]),
])
def test_draft_server_lists_refuse_what_check_refuses(servers, words):
    with pytest.raises(UsageError) as e:
        DraftRequest("smollm2-135m-eagle3", servers=servers)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words)


def test_draft_server_refusal_on_the_command_line():
    assert_one_line_error(run_cli("draft", "smollm2-135m-eagle3", "--server", "sglang@0.5.12, vllm"), ["a space"])
    ok = run_cli("draft", "smollm2-135m-eagle3", "--server", "sglang@0.5.12,vllm", "--summary")
    assert ok.returncode in (0, 1) and "VERDICT" in ok.stdout, ok
    old = run_cli("draft", "smollm2-135m-eagle3", "--server", "sglang@0.4.0", "--summary")  # not silent: UNVERIFIED
    assert old.returncode == 1 and "unverified" in old.stdout, old


# --- the converted-checkpoint cache ------------------------------------------------------------------------

@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A copy of the converted SmolLM2 checkpoint under a private XDG_CACHE_HOME."""
    made = gguf_builtin.checkpoint_dir("smollm2-135m")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    gguf_builtin.checkpoint_dir.cache_clear()
    yield made, tmp_path / "tpsim" / made.name
    gguf_builtin.checkpoint_dir.cache_clear()


def test_a_flipped_byte_in_the_cache_is_converted_again(cache, capfd):
    """A bit flipped in the cached safetensors was read and failed later as a capture difference (or gave AL 1.00
    instead of 1.21): the digests recorded at conversion are checked on read, and the checkpoint rebuilt."""
    made, mine = cache
    shutil.copytree(made, mine)
    with open(mine / "model.safetensors", "r+b") as f:
        f.seek(5_000_000)
        b = f.read(1)
        f.seek(5_000_000)
        f.write(bytes([b[0] ^ 1]))
    assert verify_file(mine / "model.safetensors")  # damaged, as tpsim verify sees it
    assert gguf_builtin.checkpoint_dir("smollm2-135m") == mine
    assert "differs from what tpsim wrote (model.safetensors): converting it again" in capfd.readouterr().err
    assert verify_file(mine / "model.safetensors") == []


def test_a_cache_from_before_the_digests_is_checked_and_kept(cache):
    made, mine = cache
    shutil.copytree(made, mine)
    (mine / gguf_builtin.SUMS).unlink()
    assert gguf_builtin.checkpoint_dir("smollm2-135m") == mine and (mine / gguf_builtin.SUMS).is_file()
    assert gguf_builtin._mismatched(mine) == []


@pytest.mark.parametrize("what", ["file", "directory"])
def test_a_path_in_the_way_is_one_line_naming_it(cache, what):
    """A file or a half-written directory where the cache goes gave exit 4 naming a temporary file."""
    _, mine = cache
    mine.parent.mkdir(parents=True)
    (mine.write_text("x") if what == "file" else mine.mkdir())
    with pytest.raises(UsageError) as e:
        gguf_builtin.checkpoint_dir("smollm2-135m")
    assert "\n" not in str(e.value) and f"{mine} is in the way" in str(e.value) and "rm -r" in str(e.value)


def test_a_full_disk_is_one_line_and_leaves_nothing(cache, monkeypatch):
    """A full disk was a traceback. The writer is made to fail as a full disk does (ENOSPC)."""
    _, mine = cache

    def full(tensors, meta):
        def write(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write
    monkeypatch.setattr(gguf_builtin, "safetensors_writer", full)
    with pytest.raises(UsageError) as e:
        gguf_builtin.checkpoint_dir("smollm2-135m")
    assert "\n" not in str(e.value) and "No space left on device" in str(e.value) and "XDG_CACHE_HOME" in str(e.value)
    assert not mine.exists() and not [p for p in mine.parent.iterdir() if p.name.startswith(".")]


# --- outputs never replace inputs ---------------------------------------------------------------------------

def test_an_output_inside_the_draft_it_reads_is_refused_even_with_force(tmp_path):
    """`acceptance --returned-hidden-states d/w.safetensors --force` overwrote the draft's own weights when they sat
    at d/w.seq0.safetensors: an output may not replace, nor sit among, the files the run reads."""
    from tpsim.app.preflight import check_output
    draft = tmp_path / "d"
    draft.mkdir()
    (draft / "w.seq0.safetensors").write_bytes(b"weights")
    for out in (draft / "w.seq0.safetensors", draft / "new.safetensors"):
        with pytest.raises(UsageError) as e:
            check_output(out, "--returned-hidden-states", "x.safetensors", True, reads=(draft,))
        assert "which this run reads" in str(e.value) and "\n" not in str(e.value)
    link = tmp_path / "link.safetensors"
    link.symlink_to(draft / "w.seq0.safetensors")
    with pytest.raises(UsageError):  # through a link too
        check_output(link, "--returned-hidden-states", "x.safetensors", True, reads=(draft,))
    check_output(tmp_path / "out.safetensors", "--returned-hidden-states", "x.safetensors", True, reads=(draft,))
    assert (draft / "w.seq0.safetensors").read_bytes() == b"weights"


def test_acceptance_refuses_to_write_into_its_draft(tmp_path):
    draft = tmp_path / "d"
    run = run_cli("draft", "smollm2-135m-eagle3", "--copy", str(draft))
    assert run.returncode == 0, run
    before = {p.name: p.read_bytes() for p in draft.iterdir()}
    r = run_cli("acceptance", "--model", "smollm2-135m", "--draft", str(draft), "--server", "sglang@0.5.13",
                "--returned-hidden-states", str(draft / "model.safetensors"), "--force")
    assert_one_line_error(r, ["which this run reads"])
    assert {p.name: p.read_bytes() for p in draft.iterdir()} == before


@pytest.mark.parametrize("sizes, words", [
    ("100000:1", ["--disaggregate 100000:1 would spawn 100001 CPU ranks"]),  # blamed a --tp 100000 never given
    ("3:1", ["--disaggregate 3:1: the prefill server's TP 3 does not divide num_attention_heads=8"]),
    ("1:3", ["--disaggregate 1:3: the decode server's TP 3 does not divide"]),
])
def test_disaggregate_refusals_name_the_degree_the_user_gave(sizes, words):
    r = run_cli("check", "--disaggregate", sizes, "--server", "sglang@0.5.12")
    line = assert_one_line_error(r, words)
    assert "--tp" not in line, line


def test_a_draft_of_another_vocabulary_is_one_line_before_any_rank(tmp_path):
    """A draft whose vocab_size is not the target's (a 40-token draft, hidden 64, on the built-in tiny: 1000
    tokens) failed inside the draft's load with a ValueError traceback; acceptance and triage --measure refuse it."""
    from test_draft_checkpoint import CONFIG, clean_tensors, write
    from tpsim.draft.config import DraftConfig
    config = {**CONFIG, "hidden_size": 64, "head_dim": 16, "intermediate_size": 96}
    draft = write(tmp_path / "d", config, clean_tensors(DraftConfig.from_json(config)))
    runs = run_clis({"acceptance": ["acceptance", "--model", "tiny", "--draft", str(draft), "--server", "vllm"],
                     "triage": ["triage", "--draft", str(draft), "--model", "tiny", "--server", "vllm", "--measure"]})
    for r in runs.values():
        assert_one_line_error(r, ["the draft's vocab_size 40 is not tiny's 1000"])
