"""Fingerprint the code tpsim's engine profiles cite, in every released wheel or sdist of each line's range,
and write the table tpsim reads (configs/fingerprints.tsv; docs/profiles.md, "How to add a release").

    python tools/fingerprint.py --cache ~/.cache/tpsim-releases
    python tools/fingerprint.py --cache DIR --package sglang --from 0.5.18 --to 0.5.23
    python tools/fingerprint.py --cache DIR --symbol python/sglang/srt/models/llama.py::LlamaModel.forward

Which symbols: every profile Source with a `path` and a `symbol` (tpsim/profiles/sglang.py + sglang_server.py, vllm.py,
trainers.py) whose repository publishes releases on PyPI, plus `--symbol PATH::SYMBOL` and, with `--extra`,
the EXTRA list below. Which releases: every release in the range of each line that cites the symbol
(tpsim.profiles.fingerprints.line_releases), and the release each source was read at.

Archives go to DIR/PACKAGE-VERSION/: wheels from `pip download --no-deps --only-binary :all:`; vLLM's sdist
(its wheels are CUDA builds of hundreds of MB) as the package index's simple API lists it, its sha256
checked (pip would build the sdist's metadata first, which for vLLM needs torch and CUDA). An archive
already there is used as it is, so a run that stopped resumes where it was; `--missing-only` also skips
the rows the table has. The table is rewritten after every release; rows not asked for are kept.
Not run by CI: it downloads. Run it on the newest Python tpsim supports: a module it cannot parse gets
no rows (and a line saying so).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tpsim.profiles import registry  # noqa: E402  (the checkout's tpsim, run from anywhere)
from tpsim.profiles.fingerprints import (ABSENT, TABLE_PATH, Key, Table, line_releases, plain,  # noqa: E402
                                         read_release, symbol_hash)
from tpsim.profiles.profile import Behaviour, Line, Source  # noqa: E402


@dataclass(frozen=True)
class Package:
    """How a repository's releases are published: the PyPI name, what a Source path has before the
    package's own path (`python/` in SGLang's repository), whether to take the sdist, and the releases
    when tpsim's registry lists none."""

    name: str
    strip: str = ""
    sdist: bool = False
    releases: tuple[str, ...] = ()


PACKAGES = {
    "sgl-project/sglang": Package("sglang", strip="python/"),
    "vllm-project/vllm": Package("vllm", sdist=True),  # its wheels are CUDA builds of several hundred MB
    "sgl-project/SpecForge": Package("specforge", releases=("0.1.0", "0.2.0")),
}
ENGINE_OF = {"sgl-project/sglang": "sglang", "vllm-project/vllm": "vllm", "sgl-project/SpecForge": "specforge"}

# Symbols fingerprinted before the profile data named them (issue 34): the code the profiles cite.
_SG = "python/sglang/srt/"
EXTRA = tuple(Key("sgl-project/sglang", _SG + path, symbol) for path, symbol in (
    ("models/deepseek_v2.py", "DeepseekV2Model.forward"),
    ("models/deepseek_v2.py", "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture"),
    ("models/deepseek_v2.py", "DeepseekV2DecoderLayer.forward"),
    ("models/llama.py", "LlamaModel.forward"),
    ("models/llama.py", "LlamaForCausalLM.set_eagle3_layers_to_capture"),
    ("models/qwen2.py", "Qwen2Model.forward"),
    ("models/qwen2.py", "Qwen2ForCausalLM.set_eagle3_layers_to_capture"),
    ("models/qwen3_moe.py", "Qwen3MoeForCausalLM.set_eagle3_layers_to_capture"),
    ("models/gpt_oss.py", "GptOssModel.forward"),
    ("models/gpt_oss.py", "GptOssForCausalLM.set_eagle3_layers_to_capture"),
    ("server_args.py", "ServerArgs._handle_model_specific_adjustments"),
    ("server_args.py", "ServerArgs.check_server_args"),
    ("model_executor/model_runner.py", "ModelRunner.initialize"),
    ("layers/communicator.py", "LayerCommunicator.prepare_attn_and_capture_last_layer_outputs"),
    ("layers/aux_hidden_states.py", "AuxHiddenStatePacker"),
)) + tuple(Key("vllm-project/vllm", path, symbol) for path, symbol in (
    ("vllm/model_executor/models/deepseek_v2.py", "DeepseekV2Model.forward"),
    ("vllm/model_executor/models/llama.py", "LlamaModel.forward"),
    ("vllm/model_executor/models/interfaces.py", "EagleModelMixin._maybe_add_hidden_state"),
    ("vllm/model_executor/models/interfaces.py", "SupportsEagle3.get_eagle3_default_aux_hidden_state_layers"),
    ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner._get_eagle3_aux_layers_from_config"),
    ("vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py", "get_eagle3_aux_layers_from_config"),
    ("vllm/config/vllm.py", "VllmConfig.use_v2_model_runner"),
))


def cited_sources(lines) -> list[tuple[Line, Source]]:
    """(line, source) for every source of every behaviour a line ever has, base and changes."""
    out = []
    for line in lines:
        cited = [getattr(line.base, f) for f in Behaviour.FIELDS]
        for change in (line.starts, *line.changes):
            cited += list(change.changes.values()) if change is not None else []
        out += [(line, c.source) for c in cited if c is not None]
    return out


def releases_of(line: Line) -> list[str]:
    package = PACKAGES.get(next((r for r, e in ENGINE_OF.items() if e == line.engine), ""))
    return line_releases(line) or list(package.releases if package else ())


def targets(extra: list[Key]) -> dict[Key, set[str]]:
    """Each symbol to fingerprint and the releases to fingerprint it at."""
    out: dict[Key, set[str]] = {}
    for line, s in cited_sources(registry.LINES):
        if not (s.path and s.symbol and s.repo in PACKAGES):
            continue
        want = out.setdefault(Key.of(s), set())
        if ENGINE_OF[s.repo] == line.engine:
            want.update(releases_of(line))
        if read_release(s) is not None:
            want.add(read_release(s))
    for key in extra:
        lines = [ln for ln in registry.LINES if ln.engine == ENGINE_OF.get(key.repo)]
        out.setdefault(key, set()).update(r for ln in lines for r in releases_of(ln))
    return out


def parse_symbol(text: str) -> Key | None:
    """`REPO_PATH::SYMBOL` (the repository is the one whose paths start that way) -> a Key; None when
    it is not that."""
    path, sep, symbol = text.partition("::")
    repo = next((r for r, p in PACKAGES.items() if path.startswith(p.strip or p.name + "/")), None)
    return Key(repo, path, symbol) if sep and symbol and repo else None


ARCHIVES = (".whl", ".gz", ".zip")


def archive(cache: Path, package: Package, version: str) -> Path | None:
    """The release's wheel or sdist in DIR/PACKAGE-VERSION/, downloaded when not there yet; None (and a
    line saying why) when it cannot be had."""
    folder = cache / f"{package.name}-{version}"
    found = sorted(p for p in folder.glob("*") if p.suffix in ARCHIVES) if folder.is_dir() else []
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    why = download_sdist(package.name, version, folder) if package.sdist else pip_wheel(package.name, version, folder)
    found = sorted(p for p in folder.glob("*") if p.suffix in ARCHIVES)
    if not found:
        if not any(folder.iterdir()):
            folder.rmdir()
        print(f"  {package.name} {version}: download failed ({why}); its rows stay unknown", flush=True)
        return None
    return found[0]


def pip_wheel(name: str, version: str, folder: Path) -> str:
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary", ":all:",
                        f"{name}=={version}", "-d", str(folder)], capture_output=True, text=True)
    return (r.stderr.strip().splitlines() or ["no wheel"])[-1]


def download_sdist(name: str, version: str, folder: Path) -> str:
    """The release's sdist as the package index lists it (the simple API pip reads, PEP 691), its sha256
    checked. Not `pip download --no-binary`: pip builds an sdist's metadata before it keeps the file, and
    vLLM's build needs torch and CUDA."""
    want = f"{name}-{version}.tar.gz"
    request = urllib.request.Request(f"https://pypi.org/simple/{name}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            sdist = next(f for f in json.load(r)["files"] if f["filename"] == want)
        data = urllib.request.urlopen(sdist["url"], timeout=600).read()
    except StopIteration:
        return f"the index lists no {want}"
    except (OSError, KeyError, ValueError) as e:
        return f"{want}: {e or type(e).__name__}"
    if hashlib.sha256(data).hexdigest() != sdist["hashes"].get("sha256"):
        return f"{want}: its sha256 differs from the index's"
    part = folder / (want + ".part")  # renamed when whole: a half-written file is never taken
    part.write_bytes(data)
    part.rename(folder / want)
    return ""


def member_texts(path: Path, inners: set[str]) -> dict[str, str]:
    """The text of each of `inners` (paths inside the package, e.g. sglang/srt/server_args.py) that a wheel
    or an sdist (whose files sit under one top folder) holds, read in one pass over the archive."""
    out = {}
    if path.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                inner = name if name in inners else name.split("/", 1)[-1]
                if inner in inners and inner not in out:
                    out[inner] = z.read(name).decode()
        return out
    with tarfile.open(path) as t:
        for member in t:
            inner = member.name.split("/", 1)[-1]
            if inner in inners and member.isfile():
                out[inner] = t.extractfile(member).read().decode()
    return out


UNPARSED = ast.Module(body=[], type_ignores=[])  # a module this Python cannot parse: no rows for it


def parse(name: str, text: str | None) -> ast.Module | None:
    if text is None:
        return None
    try:
        return ast.parse(text)
    except SyntaxError as e:
        print(f"  {name} does not parse on this Python ({e.msg}, line {e.lineno}); run the tool on a newer Python",
              flush=True)
        return UNPARSED


def fingerprint_release(path: Path, package: Package, keys: list[Key]) -> dict[Key, str]:
    """Each key's hash in one release's archive (ABSENT where the file or the symbol is missing); a key
    whose module this Python cannot parse is left out, with a line saying so."""
    inner = {k: k.path[len(package.strip):] if k.path.startswith(package.strip) else k.path for k in keys}
    texts = member_texts(path, set(inner.values()))
    trees = {i: parse(f"{path.name}: {i}", texts.get(i)) for i in set(inner.values())}
    out = {}
    for key in keys:
        tree = trees[inner[key]]
        if tree is not UNPARSED:
            out[key] = (symbol_hash(tree, key.symbol) if tree is not None else None) or ABSENT
    return out


def version(text: str | None, option: str, parser: argparse.ArgumentParser) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return registry.version_key(text)
    except ValueError:
        parser.error(f"{option} {text!r} is not a version; give one like 0.5.12")


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """Bad input: one line naming the problem and the fix, exit 2."""
        print(f"fingerprint: error: {message}; see python tools/fingerprint.py --help", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(prog="python tools/fingerprint.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="examples:\n" + __doc__.split("\n\n")[1])
    p.add_argument("--cache", required=True, type=Path, metavar="DIR",
                   help="where the wheels and sdists go (DIR/PACKAGE-VERSION/); kept between runs")
    p.add_argument("--package", choices=sorted(p.name for p in PACKAGES.values()), help="only this package")
    p.add_argument("--from", dest="first", metavar="VERSION", help="only releases from this one on")
    p.add_argument("--to", dest="last", metavar="VERSION", help="only releases up to this one")
    p.add_argument("--symbol", action="append", default=[], metavar="PATH::SYMBOL",
                   help="also this symbol (PATH as a profile Source writes it); repeatable")
    p.add_argument("--extra", action="store_true", help="also the symbols in the tool's EXTRA list")
    p.add_argument("--missing-only", action="store_true", help="skip (symbol, release) pairs the table has")
    p.add_argument("--out", type=Path, default=TABLE_PATH, help=f"the table to update (default {TABLE_PATH})")
    args = p.parse_args(argv)
    args.range = (version(args.first, "--from", p), version(args.last, "--to", p))
    keys = [parse_symbol(s) for s in args.symbol]
    if None in keys:
        p.error(f"--symbol {args.symbol[keys.index(None)]!r}: want PATH::SYMBOL, PATH as a profile Source writes it "
                "(e.g. python/sglang/srt/models/llama.py::LlamaModel.forward)")
    args.keys = keys + (list(EXTRA) if args.extra else [])
    return args


def plan(args, have: Table) -> dict[tuple[str, str], list[Key]]:
    """(repository, release) -> the keys to fingerprint in that release's archive, oldest release first."""
    lo, hi = args.range
    out: dict[tuple[str, str], list[Key]] = {}
    for key, releases in targets(args.keys).items():
        if args.package and PACKAGES[key.repo].name != args.package:
            continue
        for r in releases:
            k = registry.version_key(r)
            if (lo and k < lo) or (hi and k > hi) or (args.missing_only and have.at(key, r) is not None):
                continue
            out.setdefault((key.repo, r), []).append(key)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0], registry.version_key(kv[0][1]))))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    have = Table.parse(args.out.read_text(), str(args.out)) if args.out.is_file() else Table({})
    hashes = {k: dict(v) for k, v in have.hashes.items()}
    todo = plan(args, have)
    print(f"fingerprint: {sum(map(len, todo.values()))} (symbol, release) pairs in {len(todo)} archives; "
          f"cache {args.cache}; table {args.out}", flush=True)
    for i, ((repo, release), keys) in enumerate(todo.items(), 1):
        package = PACKAGES[repo]
        path = archive(args.cache, package, release)
        if path is None:
            continue
        got = fingerprint_release(path, package, keys)
        for key, digest in got.items():
            hashes.setdefault(key, {})[plain(release)] = digest
        args.out.write_text(Table(hashes).dump())  # after every release: a stopped run keeps what it did
        absent = sum(d == ABSENT for d in got.values())
        print(f"[{i}/{len(todo)}] {package.name} {release}: {len(got)} symbols, {absent} absent ({path.name})",
              flush=True)
    print(f"fingerprint: wrote {args.out} ({len(Table(hashes).rows())} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
