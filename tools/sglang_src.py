"""Fetch the SGLang releases tpsim's profiles quote and unpack their Python sources (issue 51 item 10).

    python tools/sglang_src.py DIR

For each release in tpsim.profiles.sglang_server.READ: `pip download --no-deps sglang==V` into DIR/wheels, then
the wheel's sglang/srt/**.py into DIR/sglang-V/sglang/srt/ (the layout tests/test_profiles_sglang.py reads through
TPSIM_SGLANG_SRC). A release already unpacked is kept: a second run downloads nothing. Exit 1 naming the
releases that could not be fetched.
"""

from __future__ import annotations

import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tpsim.profiles.registry import version_key  # noqa: E402
from tpsim.profiles.sglang_server import READ  # noqa: E402

DONE = ".unpacked"  # written last: a release half unpacked is fetched again


def unpack(wheel: Path, into: Path, prefix: str = "sglang/srt/") -> int:
    n = 0
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith(prefix) and name.endswith(".py"):
                z.extract(name, into)
                n += 1
    (into / DONE).write_text(wheel.name + "\n")
    return n


def fetch(release: str, cache: Path, dist: str = "sglang", prefix: str = "sglang/srt/",
          name: str = "sglang") -> str | None:
    """`dist==release`'s wheel's Python files under `prefix` into cache/NAME-RELEASE (None, or why not)."""
    into = cache / f"{name}-{release}"
    if (into / DONE).exists():
        return None
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                          "-d", str(wheels), f"{dist}=={release}"], capture_output=True, text=True)
    wheel = next(iter(sorted(wheels.glob(f"{dist.replace('-', '_')}-{release}-*.whl"))), None)
    if got.returncode or wheel is None:
        return f"{dist}=={release}: {(got.stderr.strip().splitlines() or ['no wheel'])[-1]}"
    unpack(wheel, into, prefix)
    wheel.unlink()  # the sources are what the tests read; the wheels are 5-100 MB each
    return None


def fetch_all(argv: list[str], tool: str, name: str, releases, **how) -> int:
    """`python tools/TOOL DIR`: every release fetched into DIR (fetch's `how`), a line of what came, exit 1 naming
    what did not."""
    if len(argv) != 1:
        print(f"usage: python tools/{tool} DIR", file=sys.stderr)
        return 2
    cache, start, read = Path(argv[0]), time.monotonic(), sorted(releases, key=version_key)
    failed = [f for r in read if (f := fetch(r, cache, name=name, **how))]
    print(f"{name} sources: {len(read) - len(failed)} of {len(read)} releases under {cache} "
          f"({time.monotonic() - start:.0f} s)")
    for f in failed:
        print(f"  not fetched: {f}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    return fetch_all(argv, "sglang_src.py", "sglang", READ)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
