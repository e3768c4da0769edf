"""Every Python example in the README and docs/ runs as written, from the repository root, and
prints what its last comment says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from clirun import ROOT, cli_env

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
EXAMPLES = [(doc, code) for doc in DOCS for code in BLOCK.findall(doc.read_text())]


def test_there_are_examples():
    assert EXAMPLES


@pytest.mark.parametrize("doc, code", EXAMPLES, ids=[f"{d.name}-{i}" for i, (d, _) in enumerate(EXAMPLES)])
def test_python_example_runs(doc: Path, code: str):
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    said = re.search(r"# (.+)\s*$", code.strip().splitlines()[-1])
    if said and code.strip().splitlines()[-1].startswith("print("):
        assert r.stdout.strip() == said.group(1).strip(), (r.stdout, said.group(1))
