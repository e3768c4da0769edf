"""`tpsim draft` (and `triage --draft-config`) on an MTP/NextN head: what the head was trained on at step 0 and at
later steps, against what each served engine version feeds it (tpsim.profiles.mtp), and a release that feeds it as
trained, replayed through the same check. docs/mtp.md describes the input.

An MTP head is a config.json with `num_nextn_predict_layers` (DeepSeek, GLM, MiMo) or `mtp_num_hidden_layers`
(Qwen3-Next, Qwen3.5) above 0: the target's own config, whose MTP layers ship in the target checkpoint. Its class is
the one the engine builds (vLLM's speculative config rewrites the target's architecture: config/speculative.py) or
a head class named directly. What it was trained on is `mtp_hidden_state`, tpsim's key (no trainer records it):
"post-norm" or "pre-norm" for every step, or {"step0": ..., "later": ...}; absent, DeepSeek's reference contract
is assumed: post-norm at every step (modeling_deepseek.py's model ends in self.norm and its rollout feeds the main
model's hidden to every step: ROCm/ATOM PR #1764)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tpsim.draft.findings import TitledFinding
from tpsim.base.errors import UsageError
from tpsim.profiles.mtp import FEEDS, SAME_HEAD, MtpFeed, Norm, feed, releases_feeding, version

MARKS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
KEY = "mtp_hidden_state"
TARGET_HEAD = {"DeepseekV3ForCausalLM": "DeepSeekMTPModel", "DeepseekV32ForCausalLM": "DeepseekV32MTPModel",
               "Glm4MoeForCausalLM": "Glm4MoeMTPModel", "Qwen3NextForCausalLM": "Qwen3NextMTP",
               "Qwen3_5ForConditionalGeneration": "Qwen3_5MTP", "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeMTP",
               "MiMoForCausalLM": "MiMoMTPModel"}
ASSUMED = (f"no {KEY} in the head's config: trained on the post-norm hidden at every step (DeepSeek's reference: "
           "modeling_deepseek.py ends its model in self.norm and feeds that hidden to every MTP step, ROCm/ATOM PR "
           "#1764); write \"mtp_hidden_state\": \"pre-norm\" (or {\"step0\": ..., \"later\": ...}) if it was not")
COST = ("measured on SmolLM2-135M with a head trained post-norm at every step, k 3: AL 1.309 fed as trained, 1.181 "
        "fed the pre-norm hidden at step 0 (paired -0.144 +- 0.013), 1.268 fed its pre-norm output back at steps 1+ "
        "(paired -0.042 +- 0.007): benchmarks/results/mtp-feedback-cpu.json, docs/mtp.md")


@dataclass(frozen=True)
class MtpHead:
    architecture: str
    step0: Norm
    later: Norm
    declared: bool  # mtp_hidden_state given


def mtp_config(path: Path) -> dict | None:
    """The config of `path` (a directory or its config.json) when it declares MTP layers, else None."""
    cfg = path / "config.json" if path.is_dir() else path
    if cfg.suffix != ".json" or not cfg.is_file():
        return None
    try:
        raw = json.loads(cfg.read_text())
    except (ValueError, OSError, RecursionError):
        return None  # the draft reader says what is wrong with it
    if not isinstance(raw, dict) or not any(isinstance(raw.get(m), int) and raw[m] > 0 for m in MARKS):
        return None
    return raw


def _norm(value, where: str) -> Norm:
    try:
        return Norm(value)
    except ValueError:
        raise UsageError(f"{where}: {KEY} {value!r} is not \"post-norm\" or \"pre-norm\"; write one of them (or "
                         "{\"step0\": ..., \"later\": ...})") from None


def head_of(raw: dict, where: str) -> MtpHead:
    archs = raw.get("architectures") or []
    arch = next((TARGET_HEAD.get(a, a) for a in archs if isinstance(a, str)), "")
    declared = raw.get(KEY)
    if declared is None:
        return MtpHead(arch, Norm.POST, Norm.POST, False)
    if isinstance(declared, dict):
        extra = sorted(set(declared) - {"step0", "later"})
        if extra or "step0" not in declared:
            raise UsageError(f"{where}: {KEY} holds {extra or 'no step0'}; write {{\"step0\": \"post-norm\", "
                             "\"later\": \"post-norm\"}")
        step0 = _norm(declared["step0"], where)
        return MtpHead(arch, step0, _norm(declared.get("later", step0.value), where), True)
    one = _norm(declared, where)
    return MtpHead(arch, one, one, True)


def _served(servers: list[str], arch: str) -> list[tuple[str, str]]:
    """(engine, release) per --server, else every release read for the head's class."""
    if servers:
        out = []
        for s in servers:
            engine, _, release = s.partition(":")[0].partition("@")
            engine = engine.removesuffix("-cpu")
            if engine not in ("vllm", "sglang") or not release:
                raise UsageError(f"--server {s!r}: an MTP head is judged per release: write vllm@0.32.0 or "
                                 "sglang@0.5.23 (the releases read: docs/mtp.md)")
            out.append((engine, release))
        return out
    names = {arch, SAME_HEAD.get(arch, arch)}
    return [(f.engine, ".".join(map(str, f.last))) for f in FEEDS if names & set(f.architectures)]


def _mismatch(head: MtpHead, f: MtpFeed) -> list[tuple[str, Norm, Norm, object]]:
    return [(step, fed.value, trained, fed.source) for step, fed, trained in
            (("step 0", f.step0, head.step0), ("steps 1+", f.later, head.later)) if fed.value is not trained]


def _seen(f, engine: str, release: str) -> str:
    """Where the feed `f` at `release` comes from: the code read, and the engine run where one observed it."""
    if (engine, version(release)) in f.observed:
        return (f"read from {engine} {release}'s released code and observed on its CPU build "
                "(tests/test_engine_mtp.py)")
    return f"read from {engine} {release}'s released code (not observed: no engine run)"


def _fix(head: MtpHead, engine: str) -> str:
    """A release read that feeds the head as trained (the same engine first), replayed through `feed` again."""
    for e in (engine, *({"vllm", "sglang"} - {engine})):
        for first, last in releases_feeding(e, head.architecture, head.step0, head.later):
            again = [feed(e, r, head.architecture) for r in (first, last)]
            if all(a is not None and not _mismatch(head, a) for a in again):
                read = f" or later (read to {last})" if last != first else ""
                return (f"serve with {e}@{first}{read}, which feeds {head.step0.value} at step 0 and "
                        f"{head.later.value} at steps 1+ (fix replayed: the finding clears)")
    return (f"no release read feeds {head.step0.value}/{head.later.value}: retrain the head on what the engine feeds "
            f"and write it in {KEY} (no replayed fix)")


def mtp_findings(head: MtpHead, servers: list[str]) -> tuple[list[TitledFinding], list[str]]:
    """The findings, and the servers whose feed is not read (UNVERIFIED)."""
    found, unverified = [], []
    served = _served(servers, head.architecture)
    if not served:
        unverified.append(f"{head.architecture or 'a head with no architectures'}: no engine release read serves this "
                          "class: UNVERIFIED (docs/mtp.md lists the classes read; name one with --server to judge it)")
    for engine, release in served:
        f = feed(engine, release, head.architecture)
        if f is None:
            unverified.append(f"{engine}@{release} for {head.architecture or 'a head with no architectures'}: "
                              "UNVERIFIED (not read; docs/mtp.md lists the releases read)")
            continue
        for step, fed, trained, source in _mismatch(head, f):
            found.append(TitledFinding(
                f"{engine}@{release} feeds the MTP head ({head.architecture}) the {fed.value} hidden at {step}, "
                f"trained on the {trained.value} one",
                f"{_seen(f, engine, release)}: the head reads a tensor "
                f"it never saw in training (the final norm's per-channel weight is not undone by its hnorm): nothing "
                f"fails, acceptance drops; {COST}",
                (f"{source} {source.symbol}: {source.quote}",), _fix(head, engine)))
    return found, unverified
