"""Source fingerprints: whether the code a profile cites is, at a given release, the code that was read.

Each `Source` with a `symbol` names a function, class or constant by qualified name (`A.b`: method `b` of
class `A`). tools/fingerprint.py hashes that symbol in every released wheel or sdist of the line's range
(`fingerprint`: the AST without line numbers, docstrings or comments) and writes the table this module
reads (configs/fingerprints.tsv, packaged as tpsim/builtin). A release is then READ (the release the source
was read at), SAME (the hash equals the one at the release read), CHANGED (it differs: unread code),
ABSENT (the symbol is not in that release) or UNKNOWN (no fingerprint for it). docs/profiles.md.
"""

from __future__ import annotations

import ast
import copy
import hashlib
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from pathlib import Path

from tpsim.config.loader import BUILTIN_CONFIGS
from tpsim.profiles import registry
from tpsim.profiles.cited import Source
from tpsim.profiles.profile import Behaviour, Line, Profile

TABLE_PATH = BUILTIN_CONFIGS / "fingerprints.tsv"
HEADER = ("repo", "path", "symbol", "release", "hash")
ABSENT = "absent"  # the hash column of a release whose code has no such symbol


# --- the fingerprint of a symbol ------------------------------------------------------------

def _canonical(node) -> str:
    """An AST as text, the same on every Python 3.10+: fields that are empty or None are left out (3.12
    added `type_params = []`, 3.13's ast.dump drops empty fields), positions are never included."""
    if isinstance(node, ast.AST):
        fields = [(k, v) for k, v in ast.iter_fields(node) if v is not None and v != []]
        return f"{type(node).__name__}({', '.join(f'{k}={_canonical(v)}' for k, v in fields)})"
    if isinstance(node, list):
        return f"[{', '.join(map(_canonical, node))}]"
    return repr(node)


class _NoDocstrings(ast.NodeTransformer):
    def generic_visit(self, node):
        super().generic_visit(node)
        body = getattr(node, "body", None)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
        return node


def _defined(body: list, name: str):
    """The last statement of `body` (looking into if/try/with blocks at the same level) that defines
    `name`: a def, a class or an assignment to it; None when none does."""
    found = None
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
            found = stmt
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found = stmt
        elif isinstance(stmt, (ast.If, ast.Try, ast.With)):
            blocks = [stmt.body, getattr(stmt, "orelse", []), getattr(stmt, "finalbody", []),
                      *[h.body for h in getattr(stmt, "handlers", [])]]
            found = next((d for d in (_defined(b, name) for b in blocks) if d is not None), None) or found
    return found


def find_symbol(tree: ast.Module, symbol: str):
    """The node `symbol` (`A.b`: `b` in class `A`'s body) names in a module; None when it has none."""
    node = tree
    for name in symbol.split("."):
        node = _defined(getattr(node, "body", []), name)
        if node is None:
            return None
    return node


def symbol_hash(tree: ast.Module, symbol: str) -> str | None:
    """The first 16 hex digits of the sha256 of `symbol`'s normalised AST in a parsed module (None: the
    module defines no such symbol). Comments, docstrings, blank lines and line numbers do not count."""
    node = find_symbol(tree, symbol)
    if node is None:
        return None
    text = _canonical(_NoDocstrings().visit(copy.deepcopy(node)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint(source_text: str, symbol: str) -> str | None:
    """`symbol_hash` of a module's text."""
    return symbol_hash(ast.parse(source_text), symbol)


# --- the table ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Key:
    """One cited symbol: a repository, a path in it (as the Source writes it) and a qualified name."""

    repo: str
    path: str
    symbol: str

    @classmethod
    def of(cls, s: Source) -> Key:
        return cls(s.repo, s.path, s.symbol)

    @property
    def short(self) -> str:
        """`deepseek_v2.DeepseekV2Model.forward`: the module's name and the symbol."""
        return f"{Path(self.path).stem}.{self.symbol}"


def plain(release: str) -> str:
    """A tag as the package index writes the version: `v0.5.12` -> `0.5.12`."""
    return release[1:] if release[:1] == "v" and release[1:2].isdigit() else release


@dataclass(frozen=True)
class Table:
    """Per cited symbol, release -> hash (ABSENT: the release has no such symbol); a release not in it
    has no fingerprint."""

    hashes: dict[Key, dict[str, str]]

    def at(self, key: Key, release: str) -> str | None:
        return self.hashes.get(key, {}).get(plain(release))

    def rows(self) -> list[tuple[Key, str, str]]:
        out = [(k, r, h) for k, by in self.hashes.items() for r, h in by.items()]
        return sorted(out, key=lambda row: (row[0].repo, row[0].path, row[0].symbol, registry.version_key(row[1])))

    def dump(self) -> str:
        lines = ["\t".join(HEADER)] + ["\t".join((k.repo, k.path, k.symbol, r, h)) for k, r, h in self.rows()]
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str, where: str) -> Table:
        lines = text.splitlines()
        if not lines or tuple(lines[0].split("\t")) != HEADER:
            raise ValueError(f"{where}: the first line must be the header {' '.join(HEADER)}; regenerate it "
                             "with tools/fingerprint.py")
        hashes: dict[Key, dict[str, str]] = {}
        for n, line in enumerate(lines[1:], 2):
            cells = line.split("\t")
            if len(cells) != len(HEADER):
                raise ValueError(f"{where}:{n}: {len(cells)} columns, want {len(HEADER)} ({' '.join(HEADER)})")
            repo, path, symbol, release, digest = cells
            hashes.setdefault(Key(repo, path, symbol), {})[plain(release)] = digest
        return cls(hashes)


@lru_cache(maxsize=None)
def load(path: Path) -> Table:
    """The table at `path` (empty when there is no file: every release is then UNKNOWN)."""
    if not path.is_file():
        return Table({})
    return Table.parse(path.read_text(), str(path))


def builtin_table() -> Table:
    return load(TABLE_PATH)


# --- classifying a release ------------------------------------------------------------------

class Status(Enum):
    """What the fingerprints say of a cited symbol at one release."""

    READ = "read: the release the source was read at"
    SAME = "same: the cited code is unchanged from the release read"
    CHANGED = "changed: the cited code differs from the release read and was not read"
    ABSENT = "absent: the release has no such symbol"
    UNKNOWN = "unknown: no fingerprint for this release, or the source was not read at a release"


# a release's status: the first of these any of its sources has (READ before SAME: read there, the rest unchanged)
WORST_FIRST = (Status.CHANGED, Status.ABSENT, Status.UNKNOWN, Status.READ, Status.SAME)


def read_release(s: Source) -> str | None:
    """The release a source was read at (`v0.5.12` -> `0.5.12`); None for a commit or a PR."""
    ref = plain(s.ref)
    if "." not in ref:
        return None
    try:
        registry.version_key(ref)
    except ValueError:
        return None
    return ref


@dataclass(frozen=True)
class Verdict:
    """One cited source at one release."""

    source: Source
    release: str
    status: Status
    read: str | None  # the release the source was read at (None: a commit or a PR)

    @property
    def key(self) -> Key:
        return Key.of(self.source)

    def to_dict(self) -> dict:
        return {"source": str(self.source), "path": self.source.path, "symbol": self.source.symbol,
                "release": self.release, "status": self.status.name.lower(), "read": self.read}


def classify(s: Source, release: str, table: Table) -> Verdict:
    """`s` (a source with a symbol) at `release`."""
    read, key = read_release(s), Key.of(s)

    def verdict(status: Status) -> Verdict:
        return Verdict(s, plain(release), status, read)
    seen = [r for r in (read, *map(plain, s.reviewed)) if r is not None]  # the releases whose code was read
    if any(registry.version_key(r) == registry.version_key(plain(release)) for r in seen):
        return verdict(Status.READ)
    here = table.at(key, release)
    if here is None:
        return verdict(Status.UNKNOWN)
    if here == ABSENT:
        return verdict(Status.ABSENT)
    known = {table.at(key, r) for r in seen} - {None, ABSENT}
    if not known:
        return verdict(Status.UNKNOWN)
    return verdict(Status.SAME if here in known else Status.CHANGED)


# --- a line's releases, a replay's release --------------------------------------------------

def line_releases(line: Line) -> list[str]:
    """Every release of the line's engine from the one its profiles start at, oldest first."""
    known = registry.RELEASES.get(line.engine, {})
    first = line.starts
    out = []
    for version, day in sorted(known.items(), key=lambda kv: registry.version_key(kv[0])):
        if first is not None and first.release is not None:
            if registry.version_key(version) < registry.version_key(first.release):
                continue
        elif first is not None and first.merged is not None and day < first.merged:
            continue
        out.append(version)
    return out


def profile_at(line: Line, release: str) -> Profile:
    return registry.lookup(f"{line.engine}@{release}:{line.family}", line.family)


@dataclass(frozen=True)
class Classified:
    """One release of a line: the profile in force there, each of its sources with a symbol, and the
    worst of those read at a release (a source read at a commit or a PR has no release to compare with: it
    stays UNKNOWN in `verdicts` and is left out of `status`; UNKNOWN when no source counts)."""

    release: str
    profile: Profile
    verdicts: tuple[Verdict, ...]

    @property
    def status(self) -> Status:
        found = {v.status for v in self.verdicts if v.read is not None}
        return next((s for s in WORST_FIRST if s in found), Status.UNKNOWN)

    def to_dict(self) -> dict:
        return {"release": self.release, "profile": self.profile.name, "status": self.status.name.lower(),
                "sources": [v.to_dict() for v in self.verdicts]}


def at_release(profile: Profile, release: str, table: Table) -> Classified:
    return Classified(release, profile, tuple(classify(s, release, table) for s in profile.sources() if s.symbol))


def classify_line(line: Line, table: Table | None = None) -> list[Classified]:
    """Every release in the line's range, classified."""
    table = builtin_table() if table is None else table
    return [at_release(profile_at(line, r), r, table) for r in line_releases(line)]


@dataclass(frozen=True)
class Unverified:
    """A replay at a release where cited code changed (or is gone) since the release it was read at."""

    engine: str
    version: str  # as the user gave it (`latest` included)
    release: str  # the release it stands for
    verdicts: tuple[Verdict, ...]  # CHANGED or ABSENT only
    fields: dict = field(default_factory=dict, compare=False)  # source -> the behaviour fields that cite it

    @property
    def line(self) -> str:
        """In a user's words: which behaviours rest on code that changed since the release read, the file, and how
        to check (the private symbol stays in --json's sources)."""
        at = f"{self.engine}@{self.release}" + (f" ({self.version})" if plain(self.version) != self.release else "")
        newest: dict[tuple[Key, Status], Verdict] = {}  # per symbol, the newest release read says it
        for v in sorted(self.verdicts, key=lambda v: registry.version_key(v.read) if v.read else ()):
            newest[(v.key, v.status)] = v
        parts = []
        for v in newest.values():
            what = " and ".join(Behaviour.SAID[f] for f in self.fields.get(v.source, ())) or "a cited behaviour"
            if v.status is Status.ABSENT:
                parts.append(f"{what}: {v.source.path} lacks the code read at {v.read or v.source.ref}")
                continue
            edge = "after" if registry.version_key(self.release) > registry.version_key(v.read) else "before"
            parts.append(f"{what}: {v.source.path} changed {edge} {v.read}, the release read")
        check = "tpsim observe runs it here and compares" if self.engine == "vllm" else \
            f"read those files at {self.release}, or name a release read"
        return f"UNVERIFIED: {at} runs code tpsim did not read for " + "; ".join(parts) + f" (to check: {check})"

    def to_dict(self) -> dict:
        return {"engine": self.engine, "version": self.version, "release": self.release, "line": self.line,
                "sources": [v.to_dict() for v in self.verdicts]}


def release_named(engine: str, version: str) -> str | None:
    """The known release a --server version names (`latest`: the newest known); None for a date or a
    version tpsim lists no release for."""
    known = registry.RELEASES.get(engine, {})
    if not known:
        return None
    if version in ("", "latest", "main"):
        return max(known, key=registry.version_key)
    try:
        key = registry.version_key(version)
    except ValueError:
        return None
    return next((r for r in known if registry.version_key(r) == key), None)


def unverified(server: str, model_type: str, table: Table | None = None) -> Unverified | None:
    """What a replay with `--server` at a release whose cited code changed since it was read must say;
    None when nothing it cites changed (or the version is not a release with fingerprints)."""
    profile = registry.lookup(server, model_type)
    version = server.strip().partition("+")[0].partition(":")[0].partition("@")[2].strip()
    release = release_named(profile.engine, version)
    if release is None:
        return None
    found = at_release(profile, release, builtin_table() if table is None else table)
    bad = tuple(v for v in found.verdicts if v.status in (Status.CHANGED, Status.ABSENT))
    cites = {}
    for f in Behaviour.FIELDS:
        c = getattr(profile.behaviour, f)
        if c is not None:
            cites.setdefault(c.source, []).append(f)
    return Unverified(profile.engine, version or "latest", release, bad, cites) if bad else None


def taken_as(flag: str, text: str, model_type: str, table: Table | None = None) -> str | None:
    """What `flag text` (--server or --train, ENGINE[@VERSION]) was taken as, where tpsim chose: no version (the
    newest release it knows of), or a release whose cited code tpsim neither read nor fingerprinted (UNVERIFIED);
    None when the version given is one tpsim read or fingerprinted."""
    base = text.strip().partition("+")[0].partition(":")[0]
    engine, _, version = base.partition("@")
    if engine not in registry.ENGINES and engine != registry.CPU_BUILD:
        return None  # a convention (specforge-ids:1,29,57): the ids as given
    profile = registry.lookup(text, model_type)
    newest = registry.CPU_PUBLISHED if engine == registry.CPU_BUILD else None
    release = release_named(profile.engine, version or newest or "")
    parts = [] if version else [f"{flag} {text} names no version: taken as {engine}@{release or 'latest'}, the "
                                f"newest tpsim knows of (profile {profile.name}); name the release you run"]
    if release is not None and at_release(profile, release, builtin_table() if table is None else table).status \
            is Status.UNKNOWN:
        parts.append(f"UNVERIFIED: {flag} {engine}@{release}: the code that release ships was neither read nor "
                     f"fingerprinted (tpsim profiles: unknown {release}); replayed as {profile.name}, the profile "
                     "whose interval holds it")
    return "; ".join(parts) or None
