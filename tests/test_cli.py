"""The `tpsim` command line, run as `python -m tpsim ...` (a fork of the tests' CLI server, clirun).

Contract: exit 0 all good, 1 a property failed, 2 bad input, 3 a rank failed. Bad input is one
stderr line `tpsim: error: <problem and fix>`, no traceback, nothing on stdout, no file written,
and it is caught before any rank is started.

A module-scoped fixture starts every run the selected tests need up front: the runs that start
ranks all at once in the background, the quick ones two at a time. Tests then wait on their own
result. Each invocation runs exactly once, shared by the tests that read it (the TP=1 and TP=2
captures, for instance)."""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

import tpsim
from clirun import RUN_TIMEOUT_S, ROOT, Run, assert_one_line_error, run_cli
from tpsim.profiles.conventions import CONVENTIONS
from tpsim.cli.options import DEFAULT_TP
from tpsim.base.safetensors import tensor_sha256
from tpsim.config.loader import load_config

TINY = ROOT / "configs" / "tiny.yaml"
HIDDEN = 64  # tiny.yaml hidden_size
ALL_CONVENTIONS = ", ".join(CONVENTIONS)

# Bad input fails in validation, before any rank starts. The proof that no rank was started is the
# single stderr line (starting prints "tpsim: starting N gloo ranks" first); the cost bound is on CPU
# seconds (the run and the children it reaped), not wall time, because this module's runs go
# concurrently on a machine that may be busy with other work. The bound is relative: `tpsim check
# --help` (the same imports, no validation) runs the same way, under the same load, and a bad input
# may cost at most BAD_INPUT_EXTRA_CPU_S more than it. (Runs are forks of the tests' CLI server, so
# neither pays the torch import; a fixed bound that did failed under load in CI, 2026-12-02.)
BAD_INPUT_EXTRA_CPU_S = 1.5
# --- configs written next to the runs ------------------------------------------------------

def _tiny() -> dict:
    return yaml.safe_load(TINY.read_text())


def write_configs(d: Path) -> dict[str, Path]:
    d.mkdir(parents=True, exist_ok=True)
    out = {}

    def put(name: str, raw) -> None:
        out[name] = d / f"{name}.yaml"
        out[name].write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw, sort_keys=False))

    put("heads16", {**_tiny(), "num_attention_heads": 16})
    # 64 divides heads, intermediate_size 128, moe_intermediate_size and the padded vocab 1024, so
    # --tp 64 gets past the divisibility checks and reaches the spawn limit.
    put("heads64", {**_tiny(), "num_attention_heads": 64, "moe_intermediate_size": 64})
    put("no_hidden", {k: v for k, v in _tiny().items() if k != "hidden_size"})
    put("hidden_abc", {**_tiny(), "hidden_size": "abc"})
    put("empty", "")
    put("invalid", "hidden_size: [64,\nnum_hidden_layers: : 8\n")
    # The routed experts' output times 1e6 overflows float16: the capture holds Inf and the
    # finiteness property fails honestly (exit 1), without any rank failing.
    put("fp16_overflow", {**_tiny(), "routed_scaling_factor": 1.0e6})
    return out


# --- bad input -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Bad:
    id: str
    argv: tuple[str, ...]  # {cfg:NAME}: a written config; {dir}: an empty directory; {out}: {dir}/c.safetensors
    expect: tuple[str, ...]  # substrings of the one error line


BAD = [
    Bad("tp-does-not-divide-heads", ("check", "--tp", "3", "--model", "{cfg:heads16}"),
        ("--tp 3", "num_attention_heads=16")),
    Bad("capture-tp-does-not-divide-heads", ("capture", "--tp", "3", "--out", "{out}"),
        ("--tp 3", "num_attention_heads=8")),
    Bad("sglang-layer-out-of-range", ("check", "--layers=7,1,2"),
        ("layer id 7", "num_layers=8", "valid -1..6")),
    Bad("vllm-layer-out-of-range", ("resolve", "--convention", "vllm-ids", "--layers", "99", "--num-layers", "61"),
        ("layer id 99", "num_layers=61", "valid 0..61")),
    Bad("unknown-convention-check", ("check", "--convention", "sglang2"), ("'sglang2'", ALL_CONVENTIONS)),
    Bad("unknown-convention-resolve", ("resolve", "--convention", "medusa", "--num-layers", "8"),
        ("'medusa'", ALL_CONVENTIONS)),
    Bad("hf-has-no-default", ("check", "--convention", "hf-ids"), ("hf", "--layers")),
    Bad("profile-name-as-convention", ("check", "--convention", "vllm"),
        ('"vllm" names an engine profile', "write --convention vllm-ids")),
    Bad("convention-name-as-server", ("check", "--server", "vllm-ids@0.25.0"),
        ('"vllm-ids" names an idealised convention', "write --server vllm@0.25.0")),
    Bad("token-outside-vocab", ("capture", "--tokens", "1,2,5000", "--out", "{out}"),
        ("5000", "vocab_size=1000")),
    Bad("negative-token", ("capture", "--tokens=-1,2", "--out", "{out}"), ("-1", "vocab_size=1000")),
    Bad("config-missing-field", ("check", "--model", "{cfg:no_hidden}"), ("missing required field hidden_size",)),
    Bad("config-wrong-type", ("check", "--model", "{cfg:hidden_abc}"), ("hidden_size", "integer", "'abc'")),
    Bad("config-empty", ("check", "--model", "{cfg:empty}"), ("empty.yaml", "is empty")),
    Bad("config-does-not-exist", ("check", "--model", "{cfg:empty}.missing"), ("does not exist",)),
    Bad("config-invalid-yaml", ("check", "--model", "{cfg:invalid}"), ("invalid.yaml", "not valid YAML")),
    Bad("tp-over-spawn-limit", ("check", "--tp", "64", "--model", "{cfg:heads64}"), ("--tp 64", "--ignore-limits")),
    Bad("tp-not-a-list", ("check", "--tp", "1,x"), ("--tp", "'1,x'")),
    Bad("layers-not-a-list", ("check", "--layers", "a,b"), ("--layers", "'a,b'")),
    Bad("seq-len-zero", ("check", "--seq-len", "0"), ("--seq-len 0", "at least 1")),
    Bad("seq-len-negative", ("check", "--seq-len", "-3"), ("--seq-len -3", "at least 1")),
    Bad("seq-len-past-max-positions", ("capture", "--seq-len", "5000", "--out", "{out}"),
        ("--seq-len 5000", "max_position_embeddings=4096")),
    Bad("timeout-zero", ("check", "--tp", "2", "--timeout", "0"), ("--timeout 0", "positive")),
    Bad("timeout-inf", ("capture", "--timeout", "inf", "--out", "{out}"), ("--timeout inf", "positive")),
    Bad("nccl-on-cpu", ("check", "--tp", "1", "--backend", "nccl"), ("nccl", "--device cuda")),
    Bad("seed-not-an-int", ("check", "--seed", "x"), ("--seed", "'x'")),
    Bad("out-in-missing-directory", ("capture", "--out", "{dir}/no/such/c.safetensors"),
        ("does not exist", "create it")),
    Bad("out-is-a-directory", ("capture", "--out", "{dir}"), ("is a directory",)),
    Bad("resolve-without-layer-count", ("resolve", "--convention", "sglang-ids"), ("--num-layers", "--model")),
]
assert len({b.id for b in BAD}) == len(BAD)


def expand(argv: tuple[str, ...], cfgs: dict[str, Path], d: Path) -> list[str]:
    res = []
    for a in argv:
        for name, p in cfgs.items():
            a = a.replace(f"{{cfg:{name}}}", str(p))
        res.append(a.replace("{out}", str(d / "c.safetensors")).replace("{dir}", str(d)))
    return res


# --- every subprocess of the module, started once --------------------------------------------

CAP_TOKENS = "1,2,3,4,5"
CAP_LAYERS = "-1,2,5"
SLOW = ("--timeout", "300")  # collective timeout of the rank-spawning runs: generous, the machine is shared


def job_specs(cfgs: dict[str, Path], cap_dir: Path, bad_dirs: dict[str, Path]) -> dict[str, tuple[bool, list]]:
    """key -> (spawns ranks, argv)."""
    specs: dict[str, tuple[bool, list]] = {
        "check": (True, ["check", "--tp", "1,2", "--json", *SLOW]),
        "check_overflow": (True, ["check", "--tp", "1", "--seq-len", "4", "--json", "--dtype", "float16",
                                  "--model", cfgs["fp16_overflow"], *SLOW]),
        "capture_seq7": (True, ["capture", "--seq-len", "7", "--out", cap_dir / "seq7.safetensors", *SLOW]),
        "resolve_text": (False, ["resolve", "--convention", "sglang-ids", "--layers=-1,2,30", "--num-layers", "61"]),
        "resolve_json": (False, ["resolve", "--convention", "sglang-ids", "--layers=-1,2,30", "--num-layers", "61",
                                 "--json"]),
        "resolve_default": (False, ["resolve", "--convention", "sglang-ids", "--num-layers", "61", "--json"]),
        "imports_only": (False, ["check", "--help"]),  # the bad-input runs' CPU baseline
    }
    for tp in (1, 2):
        specs[f"capture_tp{tp}"] = (True, ["capture", "--tp", tp, "--tokens", CAP_TOKENS, f"--layers={CAP_LAYERS}",
                                           "--out", cap_dir / f"tp{tp}.safetensors", *SLOW])
    for b in BAD:
        specs[f"bad:{b.id}"] = (False, expand(b.argv, cfgs, bad_dirs[b.id]))
    return specs


def needed_runs(item) -> list[str]:
    """The runs a collected test of this module reads (so `-k resolve` spawns no rank)."""
    name = getattr(item, "originalname", item.name)
    params = getattr(getattr(item, "callspec", None), "params", {})
    if name == "test_bad_input_is_one_line_exit_2":
        return [f"bad:{params['case'].id}", "imports_only"]
    if name == "test_capture_file":
        return [f"capture_tp{params['tp']}"]
    return {"test_resolve_text": ["resolve_text"], "test_resolve_json": ["resolve_json"],
            "test_resolve_sglang_default_on_61_layers": ["resolve_default"],
            "test_capture_tp2_matches_tp1": ["capture_tp1", "capture_tp2"],
            "test_capture_seq_len": ["capture_seq7"],
            "test_capture_leaves_no_temporary": ["capture_tp1", "capture_tp2", "capture_seq7"],
            "test_check_json_tp_1_2": ["check"], "test_check_failing_property_exits_1": ["check_overflow"],
            }.get(name, [])  # a test missing here still works: its runs start when it reads them


class Runs:
    """Each run starts at most once: up front for the selected tests, else on first use. Runs that
    spawn ranks all start at once in the background; quick ones run two at a time."""

    def __init__(self, specs: dict[str, tuple[bool, list]], cfgs: dict[str, Path], cap_dir: Path,
                 bad_dirs: dict[str, Path]):
        self.specs, self.cfgs, self.cap_dir, self.bad_dirs = specs, cfgs, cap_dir, bad_dirs
        self.futures: dict[str, Future] = {}
        self.heavy = ThreadPoolExecutor(max_workers=len([k for k, (h, _) in specs.items() if h]))
        self.light = ThreadPoolExecutor(max_workers=2)

    def start(self, key: str) -> None:
        if key not in self.futures:
            heavy, argv = self.specs[key]
            self.futures[key] = (self.heavy if heavy else self.light).submit(run_cli, *argv)

    def __getitem__(self, key: str) -> Run:
        self.start(key)
        return self.futures[key].result(timeout=2 * RUN_TIMEOUT_S)

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        self.light.shutdown(wait=True)
        self.heavy.shutdown(wait=True)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    cfgs = write_configs(base / "configs")
    cap_dir = base / "captures"
    cap_dir.mkdir()
    bad_dirs = {}
    for b in BAD:
        bad_dirs[b.id] = base / "bad" / b.id
        bad_dirs[b.id].mkdir(parents=True)
    r = Runs(job_specs(cfgs, cap_dir, bad_dirs), cfgs, cap_dir, bad_dirs)
    mine = [item for item in request.session.items if item.path == Path(__file__).resolve()]
    keys = dict.fromkeys(k for item in mine for k in needed_runs(item))
    for k in sorted(keys, key=lambda k: not r.specs[k][0]):  # rank-spawning runs first
        r.start(k)
    yield r
    r.close()


# --- 1. bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("case", BAD, ids=lambda b: b.id)
def test_bad_input_is_one_line_exit_2(case: Bad, runs: Runs):
    r = runs[f"bad:{case.id}"]
    assert_one_line_error(r, case.expect)
    base = runs["imports_only"]
    assert base.returncode == 0, base
    assert r.cpu_s < base.cpu_s + BAD_INPUT_EXTRA_CPU_S, (r, base)
    # Nothing written: neither the --out file nor write_capture's temporary, nor a directory.
    assert sorted(p.name for p in runs.bad_dirs[case.id].iterdir()) == []


# --- 2. resolve ------------------------------------------------------------------------------

def test_resolve_text(runs: Runs):
    r = runs["resolve_text"]
    assert r.returncode == 0, r
    assert r.stderr == "", r
    assert "embed, out(2), out(30)" in r.stdout, r
    assert "[0, 3, 31]" in r.stdout, r
    assert "layers_to_capture: [0, 3, 31]" in r.stdout, r


def test_resolve_json(runs: Runs):
    r = runs["resolve_json"]
    assert r.returncode == 0, r
    d = json.loads(r.stdout)
    assert d["convention"] == "sglang-ids"
    assert d["num_layers"] == 61
    assert d["ids"] == [-1, 2, 30]
    assert d["used_default"] is False
    assert d["positions"] == ["embed", "out(2)", "out(30)"]
    assert d["layers_to_capture"] == [0, 3, 31]
    assert d["equivalent_ids"]["sglang-ids"] == [-1, 2, 30]
    assert d["equivalent_ids"]["vllm-ids"] == [0, 3, 31]
    assert d["equivalent_ids"]["specforge-ids"].startswith("unreachable:")  # specforge-ids cannot say embed


def test_resolve_sglang_default_on_61_layers(runs: Runs):
    r = runs["resolve_default"]
    assert r.returncode == 0, r
    d = json.loads(r.stdout)
    assert d["used_default"] is True and d["ids"] is None
    assert d["layers_to_capture"] == [2, 30, 58]
    assert d["positions"] == ["out(1)", "out(29)", "out(57)"]
    assert d["equivalent_ids"]["specforge-ids"] == [1, 29, 57]


# --- 3. capture ------------------------------------------------------------------------------

def read_capture(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.mark.parametrize("tp", [1, 2])
def test_capture_file(runs: Runs, tp: int):
    r = runs[f"capture_tp{tp}"]
    assert r.returncode == 0, r
    assert "Traceback" not in r.stdout + r.stderr, r
    path = runs.cap_dir / f"tp{tp}.safetensors"
    assert f"wrote {path}" in r.stdout, r
    tensors, meta = read_capture(path)
    assert set(tensors) == {"aux_hidden_states", "input_ids"}
    cap, ids = tensors["aux_hidden_states"], tensors["input_ids"]
    assert list(cap.shape) == [5, 3 * HIDDEN]
    assert cap.dtype == torch.float32
    assert bool(torch.isfinite(cap).all())
    assert ids.tolist() == [1, 2, 3, 4, 5]
    for key in ("layers", "convention", "positions", "tp", "dtype", "config_sha256", "tpsim_version"):
        assert key in meta, f"metadata lacks {key}: {meta}"
    assert meta["layers"] == CAP_LAYERS
    assert meta["convention"] == "sglang-ids"
    assert meta["positions"] == "embed,out(2),out(5)"
    assert meta["tp"] == str(tp)
    assert meta["dtype"] == "float32"
    assert meta["config_sha256"] == load_config(TINY).sha256()
    assert meta["tpsim_version"] == tpsim.__version__
    assert meta["sha256.aux_hidden_states"] == tensor_sha256(cap)
    assert meta["sha256.input_ids"] == tensor_sha256(ids)


def test_capture_tp2_matches_tp1(runs: Runs):
    for tp in (1, 2):
        assert runs[f"capture_tp{tp}"].returncode == 0, runs[f"capture_tp{tp}"]
    one = read_capture(runs.cap_dir / "tp1.safetensors")[0]["aux_hidden_states"]
    two = read_capture(runs.cap_dir / "tp2.safetensors")[0]["aux_hidden_states"]
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-5)
    # The vocab-parallel embedding all-reduce adds exact zeros from the rank that does not own a
    # token, so the embed slice is bitwise equal.
    assert torch.equal(two[:, :HIDDEN], one[:, :HIDDEN])
    assert not torch.equal(two[:, HIDDEN:], torch.zeros_like(two[:, HIDDEN:]))


def test_capture_seq_len(runs: Runs):
    r = runs["capture_seq7"]
    assert r.returncode == 0, r
    tensors, meta = read_capture(runs.cap_dir / "seq7.safetensors")
    assert list(tensors["aux_hidden_states"].shape) == [7, 3 * HIDDEN]
    assert tensors["input_ids"].shape == (7,)
    assert all(0 <= t < 1000 for t in tensors["input_ids"].tolist())
    assert meta["layers"] == "default"
    assert meta["positions"] == "out(1),out(3),out(4)"
    assert meta["tp"] == str(DEFAULT_TP)  # capture runs one degree: the default rule's


def test_capture_leaves_no_temporary(runs: Runs):
    for key in ("capture_tp1", "capture_tp2", "capture_seq7"):
        assert runs[key].returncode == 0, runs[key]
    assert sorted(p.name for p in runs.cap_dir.iterdir()) == ["seq7.safetensors", "tp1.safetensors",
                                                             "tp2.safetensors"]


# --- 4. check --------------------------------------------------------------------------------

def test_check_json_tp_1_2(runs: Runs):
    r = runs["check"]
    assert r.returncode == 0, r
    assert "Traceback" not in r.stdout + r.stderr, r
    d = json.loads(r.stdout)
    assert d["ok"] is True
    assert d["dtype"] == "float32" and d["tokens"] == 16
    assert d["convention"]["positions"] == ["out(1)", "out(3)", "out(4)"]
    rows = {row["tp"]: row for row in d["rows"]}
    assert sorted(rows) == [1, 2]
    for tp, row in rows.items():
        assert row["ok"] is True and row["failures"] == [], row
        assert row["ranks"] == tp
        assert row["expected_shape"] == [16, 192]
        assert row["identical"] is True
        assert row["rel_err"] is not None and row["rel_err"] <= d["tolerance"]
    assert rows[1]["all_reduces"] == rows[1]["expected_all_reduces"] == 0
    assert rows[2]["all_reduces"] == rows[2]["expected_all_reduces"] == 17  # 1 + 2 * 8 layers


def test_check_failing_property_exits_1(runs: Runs):
    """Negative control for exit 1: float16 overflows to Inf, and the finiteness property fails."""
    r = runs["check_overflow"]
    assert r.returncode == 1, r
    assert "Traceback" not in r.stdout + r.stderr, r
    d = json.loads(r.stdout)
    assert d["ok"] is False
    (row,) = d["rows"]
    assert row["tp"] == 1 and row["ok"] is False
    assert any(f.startswith("the capture holds NaN or Inf; the first NaN/Inf appeared at layers.1.mlp.partial "
                            "(token ") for f in row["failures"]), row
