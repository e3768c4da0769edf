"""The released SGLang sources the profiles quote (`make sglang-src` unpacks them; CI requires them): a function's
text, to find a quote in, and a released function itself, to run against tpsim's replay of it."""

from __future__ import annotations

import ast
import os
from functools import lru_cache
from pathlib import Path

import pytest

WHEELS = Path(os.environ.get("TPSIM_SGLANG_SRC") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
              / "tpsim" / "sglang-src")  # sglang-X/sglang/srt/... per release: `make sglang-src` fetches them there


def no_sources(why: str) -> None:
    """CI (.ci/run) fetches the releases and sets TPSIM_REQUIRE_SGLANG_SRC: there a missing release fails."""
    if os.environ.get("TPSIM_REQUIRE_SGLANG_SRC"):
        pytest.fail(f"{why}: `make sglang-src` fetches it", pytrace=False)
    pytest.skip(why)


def _file(release: str, path: str) -> Path:
    """`path` as a source names it (python/sglang/srt/...) or relative to srt/."""
    return WHEELS / f"sglang-{release}" / "sglang/srt" / path.removeprefix("python/").removeprefix("sglang/srt/")


def _node(release: str, path: str, symbol: str) -> tuple[str, ast.AST | None] | None:
    f = _file(release, path)
    if not f.exists():
        return None
    text = f.read_text()
    node: ast.AST | None = ast.parse(text)
    for part in symbol.split("."):
        node = next((n for n in getattr(node, "body", []) if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            break
    return text, node


@lru_cache(maxsize=None)
def body(release: str, path: str, symbol: str) -> str | None:
    """`symbol`'s source in `path` at `release`, whitespace folded; "" when it is not defined, None without the
    release's sources."""
    found = _node(release, path, symbol)
    if found is None:
        return None
    text, node = found
    return "" if node is None else " ".join("\n".join(text.splitlines()[node.lineno - 1:node.end_lineno]).split())


def released_function(release: str, path: str, name: str, **scope):
    """The top-level function `name` of `path` at `release`, compiled alone with `scope` as its globals (the
    names it calls that are not under test); skips (fails in CI) without the release's sources."""
    found = _node(release, path, name)
    if found is None:
        no_sources(f"no unpacked sglang {release} wheel under {WHEELS} (TPSIM_SGLANG_SRC)")
    text, node = found
    assert isinstance(node, ast.FunctionDef), f"{name} is not a function of {path} at {release}"
    node.decorator_list = []
    code = compile(ast.Module([node], []), f"sglang-{release}/{path}", "exec")
    namespace = dict(scope)
    exec(code, namespace)  # noqa: S102 - the released function, read from the wheel, run on drawn inputs
    return namespace[name]


def released_definitions(release: str, path: str, names: tuple[str, ...], **scope) -> dict:
    """The top-level functions, classes and constants `names` of `path` at `release`, compiled together (decorators
    kept, the file's `from __future__` import with them) with `scope` as their globals (the imports they use);
    skips (fails in CI) without the release's sources. A name the release does not define is left out."""
    f = _file(release, path)
    if not f.exists():
        no_sources(f"no unpacked sglang {release} wheel under {WHEELS} (TPSIM_SGLANG_SRC)")
    tree = ast.parse(f.read_text())

    def named(n: ast.AST) -> str | None:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            return n.name
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name):
            return n.targets[0].id
        return None

    future = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
    kept = [n for n in tree.body if named(n) in names]
    namespace = dict(scope)
    exec(compile(ast.Module([*future, *kept], []), f"sglang-{release}/{path}", "exec"), namespace)  # noqa: S102
    return namespace
