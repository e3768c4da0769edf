"""The package order docs/architecture.md declares holds in the code: every import, function-level
ones included, points from a package to itself or to one below it, and no module sits loose at
tpsim/ besides __init__ and __main__."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tpsim"
TOP = {"__init__", "__main__"}  # the package itself: the version, `python -m tpsim`


def declared_order() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return re.search(r"<!-- package order: ([a-z ]+) -->", text).group(1).split()


def unit(f: Path) -> str:
    """The package a file belongs to (`__init__`/`__main__` for tpsim's own two)."""
    parts = f.relative_to(PKG).with_suffix("").parts
    return parts[0]


def part(name: str) -> str:
    """A name right under tpsim: a package or module, else one of tpsim/__init__.py's own."""
    return name if (PKG / name).is_dir() or (PKG / f"{name}.py").exists() else "__init__"


def imported(f: Path) -> set[str]:
    """The top-level tpsim packages (or modules) `f` imports from, at any depth of the file."""
    out = set()
    package = ".".join(f.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [base] if base != "tpsim" else [f"tpsim.{a.name}" for a in node.names]
        out |= {part(n.split(".")[1]) for n in names if n.startswith("tpsim.")}
    return out


def arrows() -> list[tuple[str, str, str]]:
    """(file, from package, to package) for every import between two tpsim packages."""
    found = []
    for f in sorted(PKG.rglob("*.py")):
        if "builtin" in f.parts:
            continue
        src = unit(f)
        found += [(str(f.relative_to(ROOT)), src, dst) for dst in sorted(imported(f)) if dst != src]
    return found


def upward(order: list[str], found) -> list[str]:
    rank = {p: i for i, p in enumerate(order)}
    return [f"{f}: {src} -> {dst}" for f, src, dst in found
            if src not in TOP and dst not in TOP and rank[src] < rank[dst]]


def test_every_package_is_placed_and_nothing_is_loose():
    order = declared_order()
    packages = {d.name for d in PKG.iterdir() if d.is_dir() and (d / "__init__.py").exists()}
    assert packages == set(order), (packages ^ set(order))
    loose = {f.stem for f in PKG.glob("*.py")} - TOP
    assert not loose, f"modules loose at tpsim/: {sorted(loose)}"


def test_every_import_points_down_the_declared_order():
    assert upward(declared_order(), arrows()) == []


@pytest.mark.parametrize("pair", [("base", "cli"), ("run", "app"), ("capture", "offline")])
def test_the_check_catches_an_arrow_that_runs_up(pair):
    """The order reversed for one pair: the imports that exist between them are then found."""
    low, high = pair
    order = declared_order()
    swapped = [high if p == low else low if p == high else p for p in order]
    found = arrows()
    assert any(src == high and dst == low for _, src, dst in found), pair
    assert upward(swapped, found)


def literal_compares(names: list[str], skip: set[str]) -> list[str]:
    """file:line of every `==`/`!=`/`in` against one of `names` as a string literal in tpsim/."""
    alt = "|".join(re.escape(n) for n in names)
    pattern = re.compile(rf"""(==|!=|\bin)\s*[(\[{{]?\s*["']({alt})["']""")
    found = []
    for f in sorted(PKG.rglob("*.py")):
        rel = str(f.relative_to(ROOT))
        if rel in skip:
            continue
        found += [f"{rel}:{n}" for n, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    return found


def test_strategies_modes_and_collectives_are_compared_as_types_not_strings():
    from tpsim.modes import KINDS, Strategy
    from tpsim.parallel.ops import Op
    assert literal_compares([s.value for s in Strategy], {"tpsim/modes/strategy.py"}) == []
    assert literal_compares([k.name for k in KINDS], {"tpsim/modes/base.py"}) == []
    # Op is a StrEnum: `op == "all_reduce"` would hold silently, so the names and short forms are checked here
    assert literal_compares([o.value for o in Op] + [o.short for o in Op], {"tpsim/parallel/ops.py"}) == []
