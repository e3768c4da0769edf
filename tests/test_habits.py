"""The CLI habits users expect: values that start with a minus, no abbreviations, dtype aliases, one
--tp default rule, help with a description and an example, options refused where they would be
ignored, one overwrite rule for every writer, quiet pipes and Ctrl-C, tables that fit 100 columns,
verdicts coloured only on a terminal, and unsupported models named by their model_type."""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from clirun import ROOT, cli_env, run_cli
from tpsim.cli.main import build_parser, run_command
from tpsim.cli.options import DEFAULT_TP, SERVED_TP_RULE, TP_RULE
from tpsim.base.errors import UsageError

PARSER = build_parser()
COMMANDS = {name: p for a in PARSER._actions if isinstance(a, argparse._SubParsersAction)
            for name, p in a.choices.items()}
VALUE_OPTIONS = sorted((cmd, opt) for cmd, p in COMMANDS.items() for opt, a in p._option_string_actions.items()
                       if opt.startswith("--") and a.nargs in (None, "?"))
ALIGN = ["align", "--train", "specforge-ids:1,29,57", "--serve", "sglang-ids:-1,2,30", "--num-layers", "61"]


def parse(argv: list[str]) -> argparse.Namespace:
    return PARSER.parse_args(argv)


# --- values that start with a minus ----------------------------------------------------------

@given(cmd_opt=st.sampled_from(VALUE_OPTIONS), value=st.integers(max_value=-1), rest=st.lists(
    st.integers(), max_size=3))
@example(cmd_opt=("resolve", "--layers"), value=-1, rest=[2, 30])
@example(cmd_opt=("align", "--seed"), value=-1, rest=[])
def test_a_value_starting_with_a_minus_parses_as_with_equals(cmd_opt, value, rest):
    """`--opt -1,2,30` is `--opt=-1,2,30`, for every option that takes a value, whatever the value
    then means to the command (the command validates it; the parser must not call it an option)."""
    cmd, opt = cmd_opt
    text = ",".join(map(str, [value, *rest]))
    dest = COMMANDS[cmd]._option_string_actions[opt].dest
    try:
        spaced = getattr(parse([cmd, opt, text]), dest)
    except UsageError as e:
        spaced = ("error", str(e))
    try:
        joined = getattr(parse([cmd, f"{opt}={text}"]), dest)
    except UsageError as e:
        joined = ("error", str(e))
    assert spaced == joined
    assert not (isinstance(spaced, tuple) and "expected one argument" in spaced[1])


def test_the_seed_case_typed_the_natural_way(capsys):
    assert run_command(["resolve", "--convention", "sglang-ids", "--layers", "-1,2,30", "--num-layers", "61"]) == 0
    assert "embed, out(2), out(30)" in capsys.readouterr().out


# --- no abbreviations ------------------------------------------------------------------------

REQUIRED = {"capture": ["--out", "x"], "export": ["--out", "x"], "triage": ["--draft-config", "x"],
            "diagnose": ["f", "--reference", "r"], "verify": ["f"], "draft": ["d"],
            "acceptance": ["--draft", "d"], "observe": ["--draft", "d"]}
LONG = sorted((cmd, opt) for cmd, p in COMMANDS.items() for opt in p._option_string_actions if opt.startswith("--"))


@given(cmd_opt=st.sampled_from(LONG), cut=st.integers(min_value=3))
@example(cmd_opt=("check", "--layers"), cut=7)
@example(cmd_opt=("draft", "--help"), cut=3)  # a command with a required positional
@example(cmd_opt=("acceptance", "--backend"), cut=3)  # a command with a required option
@settings(max_examples=60)
def test_a_prefix_of_an_option_is_refused_and_the_option_suggested(cmd_opt, cut):
    cmd, opt = cmd_opt
    prefix = opt[:min(cut, len(opt) - 1)]
    if prefix in COMMANDS[cmd]._option_string_actions or len(prefix) < 3:
        return
    value = ["1"] if COMMANDS[cmd]._option_string_actions[opt].nargs != 0 else []
    with pytest.raises(UsageError, match=f"unrecognized arguments: {prefix}"):
        parse([cmd, *REQUIRED.get(cmd, []), prefix, *value])


def test_explain_has_no_layers_option_to_misread():
    with pytest.raises(UsageError, match=r"--layers 3 \(did you mean --layer\?\)"):
        parse(["explain", "--layers", "3"])


# --- dtype, --tp, help -------------------------------------------------------------------------

@pytest.mark.parametrize("alias, name", [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32"),
                                         ("BF16", "bfloat16"), ("float32", "float32")])
@pytest.mark.parametrize("cmd", ["check", "capture", "explain", "align", "triage", "export"])
def test_dtype_aliases(cmd, alias, name):
    assert parse([cmd, "--dtype", alias, *(["--out", "x"] if cmd in ("capture", "export") else []),
                  *(["--draft-config", "x"] if cmd == "triage" else [])]).dtype == name


def test_one_tp_default_rule_stated_in_every_help():
    for cmd, p in COMMANDS.items():
        action = p._option_string_actions.get("--tp")
        if action is None:
            continue
        assert action.default is None, cmd  # decided by the rule, not per command
        rule = ("default 1,2,4,8",) if cmd == "check" else (TP_RULE, SERVED_TP_RULE)
        assert any(r in action.help for r in rule), cmd


@pytest.mark.parametrize("cmd", ["capture", "explain", "triage"])
def test_a_single_degree_command_runs_at_the_default_tp(cmd, tmp_path):
    from tpsim.cli.run_args import one_tp
    assert one_tp(parse([cmd, "--draft-config", "x"] if cmd == "triage" else
                        [cmd, "--out", "x"] if cmd == "capture" else [cmd])) == DEFAULT_TP


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_every_command_help_has_a_description_and_an_example(cmd):
    p = COMMANDS[cmd]
    assert p.description and len(p.description) > 40, cmd
    assert p.epilog and "example" in p.epilog and f"tpsim {cmd}" in p.epilog, cmd
    text = p.format_help()
    for a in p._actions:
        if a.option_strings and a.help != argparse.SUPPRESS:
            assert a.help, f"tpsim {cmd} {a.option_strings[0]} has no help"
    assert "examples" in text or "example:" in text


def test_top_level_help_describes_tpsim():
    text = PARSER.format_help()
    assert "EAGLE-3" in text and "triage" in text


@pytest.mark.parametrize("extra", [["--tp", "8"], ["--dtype", "bf16"], ["--seed", "3"], ["--seq-len", "4"],
                                   ["--override", "num_hidden_layers=4"], ["--device", "cpu"]])
def test_align_refuses_run_options_without_a_model(extra, capsys):
    assert run_command([*ALIGN, *extra]) == 2
    err = capsys.readouterr().err
    assert extra[0] in err and "--model" in err


# --- files -------------------------------------------------------------------------------------

def capture(out: Path, *extra) -> subprocess.CompletedProcess:
    return run_cli("capture", "--tp", "1", "--seq-len", "3", "--out", out, *extra)


def test_outputs_get_the_mode_the_umask_gives(tmp_path):
    out = tmp_path / "c.safetensors"
    r = subprocess.run(["sh", "-c", f'umask 022 && exec "{sys.executable}" -m tpsim capture --tp 1 --seq-len 3 '
                                    f'--out "{out}"'], env=cli_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_overwriting_needs_force_for_every_writer(tmp_path):
    out = tmp_path / "c.safetensors"
    assert capture(out).returncode == 0
    before = out.read_bytes()
    r = capture(out, "--seed", "1")
    assert r.returncode == 2 and "exists; pass --force" in r.stderr and out.read_bytes() == before, r
    assert capture(out, "--seed", "1", "--force").returncode == 0 and out.read_bytes() != before
    svg = tmp_path / "e.svg"
    svg.write_text("mine")
    r = run_cli("explain", "--tp", "1", "--svg", svg)
    assert r.returncode == 2 and "exists; pass --force" in r.stderr and svg.read_text() == "mine", r
    ckpt = tmp_path / "ckpt"
    assert run_cli("export", "--out", ckpt).returncode == 0
    r = run_cli("export", "--out", ckpt)
    assert r.returncode == 2 and "--force" in r.stderr, r


def test_rank_files_of_a_wider_run_are_refused_then_removed_with_force(tmp_path):
    out = tmp_path / "d.safetensors"
    point = ["--points", "layers.1.attn.o_proj.partial", "--seq-len", "3"]
    assert run_cli("capture", "--tp", "4", "--out", out, *point).returncode == 0
    r = run_cli("capture", "--tp", "2", "--out", out, *point)
    assert r.returncode == 2 and "--force" in r.stderr, r
    assert run_cli("capture", "--tp", "2", "--out", out, *point, "--force").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.rank0.safetensors", "d.rank1.safetensors"]


@pytest.mark.parametrize("name", ["c.pt", "c", "c.safetensors.bak"])
def test_an_out_suffix_other_than_safetensors_is_refused_with_the_fix(tmp_path, name):
    r = capture(tmp_path / name)
    stem = name.rsplit(".", 1)[0] if "." in name else name
    assert r.returncode == 2 and f"name it {stem}.safetensors" in r.stderr, r
    assert not any(tmp_path.iterdir())


def test_json_writes_no_other_file(tmp_path):
    r = run_cli("explain", "--tp", "2", "--json", cwd=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout)["tp"] == 2
    assert not any(tmp_path.iterdir())


# --- pipes and signals ---------------------------------------------------------------------------

@pytest.mark.parametrize("argv, status", [(ALIGN + ["--json"], 1), (["profiles"], 0), (["profiles", "--sources"], 0)])
def test_a_closed_pipe_ends_quietly_with_the_commands_status(argv, status):
    p = subprocess.Popen([sys.executable, "-m", "tpsim", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=cli_env(), cwd=ROOT)
    p.stdout.readline()
    p.stdout.close()  # as `| head -1` does
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == status and err == "", err


@pytest.mark.parametrize("when", [None, "starting", "forward"], ids=["importing", "ranks-starting", "running"])
def test_ctrl_c_never_prints_a_traceback(when, tmp_path):
    """SIGINT to the whole process group (what the terminal sends) while torch imports, right
    after the launcher starts spawning its ranks (they are still starting their interpreters)
    and while they run: one line, exit 130, no rank left."""
    p = subprocess.Popen([sys.executable, "-m", "tpsim", "check", "--tp", "1,2,4", "--seq-len", "64"], env=cli_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, cwd=tmp_path)
    seen = []
    if when is None:
        time.sleep(0.3)
    else:
        for line in p.stderr:  # the progress lines: "tpsim: starting 4 gloo ranks", "tpsim: TP=1: forward"
            seen.append(line.decode())
            if when in seen[-1]:
                break
    os.killpg(p.pid, signal.SIGINT)
    err = "".join(seen) + p.stderr.read().decode()
    if p.wait(timeout=120) == 0:  # it finished first
        return
    assert p.returncode == 130 and "Traceback" not in err and "tpsim: interrupted" in err, err
    deadline = time.monotonic() + 15  # the launcher has gone; its ranks follow it (pool close, death signal)
    while time.monotonic() < deadline:
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail("a rank outlived the interrupted launcher by 15 s")


def test_ranks_start_with_ctrl_c_blocked_and_then_ignore_it(rank_pool):
    """Deterministic half of the test above: a rank is spawned with SIGINT blocked (so a Ctrl-C
    during its interpreter start-up stays pending instead of raising inside an import) and then
    ignores it; the launcher alone handles Ctrl-C and stops the ranks."""
    from tpsim.testing.jobs import sigint_job
    out = rank_pool.run(sigint_job)
    assert out and all(r == {"blocked": True, "ignored": True} for r in out.values()), out


# --- output ------------------------------------------------------------------------------------

TABLES = [["check", "--tp", "1,2"], ALIGN, ["explain", "--tp", "2"], ["profiles"],
          ["align", "--draft-config", "configs/scenarios/align-default-fallback.json", "--train",
           "specforge@2026-07-01", "--server", "vllm:deepseek_v2", "--num-layers", "61"]]


@pytest.mark.parametrize("argv", TABLES, ids=lambda a: a[0] + "-" + str(len(a)))
def test_tables_fit_100_columns_and_each_note_is_said_once(argv):
    r = run_cli(*argv)
    assert r.returncode in (0, 1), r
    rows = [line for line in r.stdout.splitlines() if line.startswith(" ")]
    assert rows and max(map(len, rows)) <= 100, max(rows, key=len)
    notes = [line.split("] ", 1)[1] for line in r.stdout.splitlines() if line[:1] == "[" and "] " in line]
    assert len(notes) == len(set(notes))
    assert "default fallback: default fallback" not in r.stdout


def test_verdicts_are_coloured_on_a_terminal_only():
    plain = run_cli(*ALIGN)
    assert "\x1b[" not in plain.stdout and "NO" in plain.stdout
    env = {**cli_env(), "FORCE_COLOR": "1"}
    forced = subprocess.run([sys.executable, "-m", "tpsim", *ALIGN], env=env, capture_output=True, text=True)
    assert "\x1b[1;31mNO\x1b[0m" in forced.stdout and "\x1b[1;31mNOT ALIGNED\x1b[0m" in forced.stdout
    env["NO_COLOR"] = "1"
    no_color = subprocess.run([sys.executable, "-m", "tpsim", *ALIGN], env=env, capture_output=True, text=True)
    assert "\x1b[1;31m" not in no_color.stdout


# --- models, scenarios, the repository ---------------------------------------------------------

@pytest.mark.parametrize("model_type", ["mixtral", "qwen2", "minimax_m2"])
def test_an_unsupported_model_type_is_named_with_the_supported_ones(tmp_path, model_type):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": model_type, "hidden_size": 64, "num_key_value_heads": 2}))
    r = run_cli("check", "--model", tmp_path)
    assert r.returncode == 2 and f"model_type='{model_type}' is not supported" in r.stderr
    assert "deepseek_v2, deepseek_v3, kimi_k2, llama, qwen3, qwen3_moe, gpt_oss" in r.stderr
    assert "missing required field" not in r.stderr


def test_scenario_list_cuts_descriptions_at_a_word():
    from tpsim.app.scenarios import available, load
    r = run_cli("scenario", "--list")
    for line, name in zip(r.stdout.splitlines(), available()):
        shown = line.split(None, 1)[1]
        assert len(line) <= 100
        assert load(name).summary.startswith(shown.removesuffix(" ...")), (shown, load(name).summary)


def test_no_generated_output_is_committed():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert not [f for f in tracked if f.endswith((".svg", ".png")) and "/" not in f]


def test_options_the_given_files_or_engine_cannot_use_are_refused(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file
    f = tmp_path / "req.safetensors"  # vLLM's hidden-states connector layout: one forward, no steps
    save_file({"hidden_states": torch.zeros(4, 3, 8), "token_ids": torch.arange(4)}, str(f))
    assert run_command(["diagnose", str(f), "--reference", str(f), "--step", "1"]) == 2
    assert "--step picks a forward pass among SGLang dumper files" in capsys.readouterr().err
    draft = ROOT / "configs/drafts/ids-at-top-level.json"
    for flag in (["--enable-dp-attention"], ["--moe-a2a-backend", "deepep"], ["--enable-flashinfer-allreduce-fusion"]):
        assert run_command(["triage", "--draft-config", str(draft), "--server", "vllm", "--tp", "2", *flag]) == 2
        assert f"{flag[0]} applies only with an SGLang --server" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_every_help_example_is_a_valid_command_line(cmd):
    import shlex
    lines = [ln.strip() for ln in COMMANDS[cmd].epilog.splitlines() if ln.strip().startswith("tpsim ")]
    assert lines
    for line in lines:
        parse(shlex.split(line)[1:])  # a typo in an option or a value the parser refuses raises UsageError


@settings(max_examples=40, deadline=None)
@given(field=st.sampled_from(["dtype", "device", "tokens", "token", "timeout", "position", "pipeline", "graphs"]),
       n=st.integers(-3, 10 ** 6))
def test_a_runspec_refuses_what_cannot_run_however_it_was_built(field, n):
    """RunRequest.spec() checks the CLI's runs; a RunSpec built or replaced in Python guards itself
    (dataclasses.replace runs the same constructor): one UsageError naming the field's problem."""
    import dataclasses
    from tpsim.app.request import RunRequest
    from tpsim.base.errors import UsageError
    from tpsim.capture import Position
    from tpsim.modes import ArFusion, TensorParallel
    from tpsim.profiles.profile import GraphIds
    from tpsim.run.graphs import CudaGraphs
    from tpsim.run.pipeline import Pipeline
    spec, _ = RunRequest(tps=(1,)).spec()
    L, V = spec.cfg.num_hidden_layers, spec.cfg.vocab_size
    bad = {"dtype": dict(dtype=f"float{n}"), "device": dict(device=f"tpu{n}"), "tokens": dict(tokens=()),
           "token": dict(tokens=(V + abs(n),) if n % 2 else (-1 - abs(n),)), "timeout": dict(timeout_s=-abs(n)),
           "position": dict(positions=(Position.at_boundary(L + 1 + abs(n) % 50),)),
           "pipeline": dict(mode=ArFusion(), pipeline=Pipeline(2)),
           "graphs": dict(mode=TensorParallel(tbo=True), graphs=CudaGraphs(GraphIds.CONFIG, 1, (), ""))}[field]
    with pytest.raises(UsageError) as e:
        dataclasses.replace(spec, **bad)
    assert "\n" not in str(e.value)
    dataclasses.replace(spec)  # the request's own spec passes its constructor
