"""The README and docs/ as a user reads them: every Python example runs as written, from the
repository root, and prints what its last comment says it prints; every shell example marked
runnable runs and ends as its marker says; every relative link points to a file (and heading) that
exists; the README stays short enough to lead to the answer.

A runnable shell example is an HTML comment right before a ```console block:

    <!-- runnable: exit=1 expect="FAIL at TP=8" -->
    ```console
    $ tpsim check ...
    (output as printed, trimmed: not checked)
    ```

Lines starting with `$ ` are commands (a trailing backslash continues one on the next line; leading
`NAME=VALUE` words set the environment); they run from the repository root, `tpsim` as
`sys.executable -m tpsim` and `python` as `sys.executable`, in `clirun.cli_env()`. Every command
but the last must exit 0; the last must exit `exit` and print `expect` (stdout and stderr together).
Files the examples write under /tmp/ go to this session's own temporary directory instead.
Examples that need a GPU, torchrun or a downloaded checkpoint stay unmarked (```bash or ```text).
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from clirun import ROOT, cli_env, run_cli

README = ROOT / "README.md"
README_MAX_LINES = 250
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
EXAMPLES = [(doc, code) for doc in DOCS for code in BLOCK.findall(doc.read_text())]

MARKER = re.compile(r"^<!-- runnable:([^\n]*?)-->$", re.M)  # on a line of its own, so not one quoted in `code`
RUNNABLE = re.compile(r"^<!-- runnable:([^\n]*?)-->\n```console\n(.*?)```", re.S | re.M)
ATTRS = re.compile(r'\s*(?:exit=(?P<exit>\d+)|expect="(?P<expect>[^"]*)")')
RUN_TIMEOUT_S = 300


def parse_marker(text: str) -> tuple[int, str]:
    """`exit=N expect="..."` -> (N, expect); both are required, nothing else is allowed."""
    exit_code, expect, pos = None, None, 0
    while pos < len(text.rstrip()):
        m = ATTRS.match(text, pos)
        assert m and m.end() > pos, f"runnable marker: cannot read {text[pos:]!r} (want exit=N expect=\"...\")"
        exit_code = int(m["exit"]) if m["exit"] is not None else exit_code
        expect = m["expect"] if m["expect"] is not None else expect
        pos = m.end()
    assert exit_code is not None and expect, f"runnable marker {text!r} needs exit=N and a non-empty expect=\"...\""
    return exit_code, expect


def commands(block: str) -> list[str]:
    """The `$ ` lines of a console block, continuation lines joined."""
    out: list[str] = []
    lines = iter(block.splitlines())
    for line in lines:
        if not line.startswith("$ "):
            continue
        cmd = line[2:]
        while cmd.endswith("\\"):
            cmd = cmd[:-1] + " " + next(lines).strip()
        out.append(cmd)
    return out


def needs_engine(cmds: list[str]) -> bool:
    """A block that runs the real engine (`make engine`), run once, from the wheel, by tests/test_install.py."""
    return any(c.startswith("tpsim observe") for c in cmds)


def line_of(doc: Path, offset: int) -> int:
    return doc.read_text().count("\n", 0, offset) + 1


SHELL = [(doc, line_of(doc, m.start()), m.group(1), m.group(2))
         for doc in DOCS for m in RUNNABLE.finditer(doc.read_text())]


def argv_env(cmd: str) -> tuple[list[str], dict[str, str]]:
    words = shlex.split(cmd)
    env = cli_env()
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words, f"no command in {cmd!r}"
    if words[0] == "python":
        words[0] = sys.executable
    return words, env


@functools.lru_cache(maxsize=None)
def run_block(cmds: tuple[str, ...], scratch: str) -> tuple[tuple[str, int, str], ...]:
    """(command, exit code, stdout + stderr) of each command, in order, stopping after the first
    that fails before the last. The examples write under /tmp/: here that is `scratch`, this
    session's own directory (so two sessions never share a file), and the output says /tmp/ again.
    Cached: a block repeated in another document (the README's example shown again in docs/)
    runs once per session."""
    out = []
    for i, cmd in enumerate(cmds):
        argv, env = argv_env(cmd.replace("/tmp/", scratch + "/"))
        if argv[0] == "tpsim":  # a fork of the CLI server: what `python -m tpsim` runs, its import paid once
            r = run_cli(*argv[1:], env=env, timeout_s=RUN_TIMEOUT_S)
        else:
            r = subprocess.run(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=RUN_TIMEOUT_S)
        out.append((cmd, r.returncode, (r.stdout + r.stderr).replace(scratch + "/", "/tmp/")))
        if r.returncode != 0 and i < len(cmds) - 1:
            break
    return tuple(out)


@pytest.fixture(scope="session")
def scratch(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("docs-tmp"))


def test_there_are_examples():
    assert EXAMPLES
    assert SHELL


@pytest.mark.parametrize("doc, code", EXAMPLES, ids=[f"{d.name}-{i}" for i, (d, _) in enumerate(EXAMPLES)])
def test_python_example_runs(doc: Path, code: str):
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    said = re.search(r"# (.+)\s*$", code.strip().splitlines()[-1])
    if said and code.strip().splitlines()[-1].startswith("print("):
        assert r.stdout.strip() == said.group(1).strip(), (r.stdout, said.group(1))


def test_every_runnable_marker_sits_right_before_a_console_block():
    for doc in DOCS:
        text = doc.read_text()
        attached = {m.start() for m in RUNNABLE.finditer(text)}
        for m in MARKER.finditer(text):
            assert m.start() in attached, (f"{doc.name}:{line_of(doc, m.start())}: a runnable marker must be "
                                           f"followed on the next line by a ```console block")
            parse_marker(m.group(1))


@pytest.mark.parametrize("doc, line, marker, block", SHELL, ids=[f"{d.name}:{n}" for d, n, _, _ in SHELL])
def test_shell_example_runs(doc: Path, line: int, marker: str, block: str, scratch: str):
    exit_code, expect = parse_marker(marker)
    cmds = commands(block)
    assert cmds, f"{doc.name}:{line}: a runnable block has no `$ ` command"
    if needs_engine(cmds):
        pytest.skip("runs vLLM: tests/test_install.py runs it from the installed wheel against the engine venv")
    if doc == README:
        pytest.skip("a README example: tests/test_install.py runs it from the installed wheel, outside the checkout")
    results = run_block(tuple(cmds), scratch)
    for i, (cmd, code, output) in enumerate(results):
        want = exit_code if i == len(cmds) - 1 else 0
        assert code == want, f"{doc.name}:{line}: `{cmd}` exited {code}, not {want}\n{output}"
    assert expect in output, f"{doc.name}:{line}: `{cmds[-1]}` did not print {expect!r}\n{output}"


def test_the_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; at most {README_MAX_LINES}: move detail to docs/"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # links and images
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, all but letters, digits, `_`, `-` and spaces
    dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = FENCE.sub("", doc.read_text())
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def links() -> list[tuple[Path, str]]:
    return [(doc, target) for doc in DOCS for target in LINK.findall(FENCE.sub("", doc.read_text()))]


def test_every_relative_link_points_to_a_file_that_exists():
    checked, bad = 0, []
    for doc, target in links():
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        checked += 1
        if not dest.exists():
            bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{doc.relative_to(ROOT)}: {target} (no heading #{anchor} in {dest.name})")
    assert checked
    assert not bad, "broken links:\n" + "\n".join(bad)
