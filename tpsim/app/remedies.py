"""Every fix triage prints is one it has replayed: the fix as a change to the triage's inputs (ids
written where the server reads them, capture turned back on, another engine version, no pipeline
stages), applied, and the same triage run again. A fix is printed when its finding clears and no
finding of a new kind appears; otherwise the output says what the replay showed instead."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from tpsim.app.run_options import PP_FLAGS, PipelineAsk
from tpsim.app.served_flags import HISTORY_OF
from tpsim.profiles.algorithm import FLAG
from tpsim.app.triage import Inputs, Triage, served_flag_findings, triage
from tpsim.base.errors import UsageError
from tpsim.base.ui import step
from tpsim.offline.align import KEY, DraftConfig
from tpsim.parallel.torchrun import under_torchrun
from tpsim.profiles.draft import read_ids, write_ids, write_ids_hint
from tpsim.profiles.findings import Finding, Kind
from tpsim.profiles.profile import EmbedId, GraphIds, Profile, SpecAlgorithm
from tpsim.profiles import registry
from tpsim.profiles.history import model_file_server
from tpsim.profiles.registry import later_profiles
from tpsim.profiles.replay import replay
from tpsim.profiles.served import fixed_in
from tpsim.offline.sides import ids_capturing

IDS_KINDS = (Kind.ENGINE_FAILS, Kind.DROPPED_SLOT, Kind.KEY_FALLBACK, Kind.MISALIGNED, Kind.IDS_CHANGED)


@dataclass(frozen=True)
class Remedy:
    """A fix as what it changes (None / False: unchanged)."""

    text: str
    ids: tuple[int, ...] | None = None  # written, as the (new) server numbers them, at the key it reads first
    server: Profile | None = None
    capture_on: bool = False  # eagle_config.use_aux_hidden_state: false removed
    pp_off: bool = False
    radix_off: bool = False  # SGLang's --disable-radix-cache
    captures: tuple | None = None  # the positions `ids` are for (what training captured, or what the ids name)
    release: str | None = None  # the --server to serve, where it is a release and not `server`'s profile name
    eagle3: bool = False  # served with the EAGLE3 algorithm

    @property
    def server_name(self) -> str | None:
        return self.release or (self.server and self.server.name)

    def to_dict(self) -> dict:
        return {"text": self.text, "ids": self.ids and list(self.ids), "server": self.server_name,
                "capture_on": self.capture_on, "pp_off": self.pp_off, "radix_off": self.radix_off,
                "eagle3": self.eagle3}

    def apply(self, inputs: Inputs) -> Inputs:
        serve = self.server or inputs.serve
        raw = json.loads(json.dumps(inputs.draft.raw))
        if self.capture_on:
            raw.get("eagle_config", {}).pop("use_aux_hidden_state", None)
        if self.ids is not None:
            write_ids(raw, serve, list(self.ids))
        eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
        draft = DraftConfig(inputs.draft.path, eagle.get(KEY), raw.get(KEY), raw)
        request = inputs.request
        if self.server is not None:
            request = dataclasses.replace(request, ids=dataclasses.replace(request.ids, server=self.server.name))
        if self.pp_off:
            request = dataclasses.replace(request, pipeline=PipelineAsk())
        served = dataclasses.replace(inputs.served, radix_cache=inputs.served.radix_cache and not self.radix_off,
                                     server=self.server_name or inputs.served.server,
                                     algorithm=SpecAlgorithm.EAGLE3 if self.eagle3 else inputs.served.algorithm)
        return dataclasses.replace(inputs, serve=serve, draft=draft, request=request, served=served)


def with_draft_ids(inputs: Inputs, values: tuple[int, ...]) -> Inputs:
    """`inputs` with the draft config holding `values` at the key its server reads first (as written there,
    before the server's shift): a served configuration whose config was edited, as a fix's ids are written."""
    keys = inputs.serve.behaviour.config.value.keys
    if not keys:
        raise UsageError(f"--draft-ids: {inputs.serve.name} reads no layer ids from the draft config; leave "
                         "--draft-ids out")
    return Remedy(f"--draft-ids {','.join(map(str, values))}", ids=tuple(v + keys[0].shift for v in values)).apply(inputs)


def replay_fixes(t: Triage, tried: dict[str, Triage] | None = None) -> None:
    """Each finding's fix applied and replayed; the finding keeps it only when it clears and opens nothing
    new (`Finding.replayed`), else its fix says what the replay showed. `tried`: the replays by change, shared
    with `plan`."""
    if under_torchrun():  # a replay runs the check again: every rank would have to follow rank 0's findings
        t.findings = [dataclasses.replace(f, fix=f"{f.fix} (not replayed under torchrun: run triage without "
                                                  "torchrun to replay it)") for f in t.findings]
        return
    kinds = {f.kind for f in t.findings}
    tried = {} if tried is None else tried
    out = []
    for f in t.findings:
        said = []
        for remedy in remedies_for(t, f):
            if remedy.text not in tried:
                with step(f"replaying the fix for finding {len(out) + 1} of {len(t.findings)} ({f.kind.value})"):
                    tried[remedy.text] = triage(remedy.apply(t.inputs))
            after = tried[remedy.text]
            new = sorted({g.kind.value for g in after.findings} - {k.value for k in kinds})
            if any(g.kind is f.kind for g in after.findings):
                said.append(f"{remedy.text}: the finding stays")
            elif new:
                said.append(f"{remedy.text}: clears it and opens {'; '.join(new)}")
            else:
                out.append(dataclasses.replace(f, fix=remedy.text, replayed=True))
                t.fixes[len(out) - 1] = remedy
                t.left[len(out) - 1] = len(after.findings)
                break
        else:
            out.append(dataclasses.replace(f, fix="none that tpsim replayed clears it" +
                                           (f" (tried: {'; '.join(said)})" if said else "")))
    t.findings = out


def remedies_for(t: Triage, f: Finding) -> list[Remedy]:
    """The changes that should clear `f`, the least disruptive first."""
    L = t.replay.num_layers
    if f.kind is Kind.KEY_FALLBACK:  # the ids the config holds at a key the server never reads, as training read them
        meant = replay(t.train, t.config.ignored, L)
        return _some(_ids(t, t.serve, meant.positions, t.config.ignored, "what the config's ids name"))
    if f.kind in IDS_KINDS:
        trained = _trained_ids(t)
        restore = _ids(t, t.serve, _wanted(t), trained, "the ids training used, restored") if trained else None
        out = _some(restore if restore is not None and list(restore.ids) == trained else _ids(t, t.serve, _wanted(t)))
        if f.kind is Kind.ENGINE_FAILS and t.replay.crashed:  # each version that captures the embedding
            out += [_upgrade(t, q) for q in _every(t.serve, lambda q: q.behaviour.embed.value is EmbedId.CAPTURED)]
        return out
    if f.kind is Kind.CAPTURE_OFF:  # and, where the server reads the ids elsewhere, written there too
        on = "remove use_aux_hidden_state: false from eagle_config"
        return [Remedy(on, capture_on=True)] + [dataclasses.replace(r, text=f"{on}, and {r.text}", capture_on=True)
                                                for r in _some(_ids(t, t.serve, _wanted(t)))]
    if f.kind is Kind.SERVED_MODE:
        return [_upgrade(t, q) for q in _every(t.serve, lambda q: fixed_in(t.serve, [q], t.mode) is not None)]
    if f.kind is Kind.GRAPH_IDS:
        return [_upgrade(t, q) for q in _every(t.serve, lambda q: q.behaviour.graphs is not None and
                                               q.behaviour.graphs.value is GraphIds.CONFIG)]
    if f.kind is Kind.CAPTURE_IGNORED or not t.serve.behaviour.captures:  # each later version that wires it
        wiring = t.serve.behaviour.wiring  # otherwise, oldest first: the next may refuse the launch instead
        return [_upgrade(t, q) for q in _every(t.serve, lambda q: q.behaviour.wiring != wiring)]
    if f.kind in (Kind.PREFIX_CACHE, Kind.PD_HANDOFF, Kind.UBATCH_MERGE):  # the first release whose own behaviour clears it
        flag = [Remedy("serve with --disable-radix-cache", radix_off=True)] if f.kind is Kind.PREFIX_CACHE else []
        return _some(_flag_upgrade(t, f.kind)) + flag
    if f.kind is Kind.ALGORITHM:
        return [Remedy(f.fix, eagle3=True)]
    if f.kind in (Kind.PIPELINE, Kind.ENGINE_REFUSES):
        return [Remedy(f"serve without pipeline parallelism ({PP_FLAGS.get(t.serve.engine, '--pp')} 1)", pp_off=True)]
    return []


def _flag_upgrade(t: Triage, kind: Kind) -> Remedy | None:
    """Serve the first release after the served one whose own behaviour of the flag (kept outside the model files:
    tpsim.app.served_flags) clears `kind`: that release as --server, its capture replayed as the model file it runs;
    the change it holds named by its PR (and, where the change has no first release, its merge date)."""
    history, engine = HISTORY_OF[kind], t.serve.engine
    model = t.serve.name.partition(":")[2].partition("+")[0]
    served = registry.when(engine, _version(t.served.server or t.serve.name) or "latest")
    for release in sorted(registry.RELEASES.get(engine, {}), key=registry.version_key):
        if served.release is None or registry.version_key(release) <= served.release or "rc" in release:
            continue  # a release candidate is not what a fix asks a user to serve
        name = f"{engine}@{release}" + (f":{model}" if model else "")
        if not history.read(name):
            continue
        q = registry.lookup(model_file_server(name, "")[0], t.inputs.target.real.model_type)
        there = {g.kind for g in served_flag_findings(t, dataclasses.replace(t.served, server=name), q)}
        if not there <= {f.kind for f in t.findings} - {kind}:  # still there, or another flag's finding opens
            continue
        since = history.at(name).versions.since
        why = "" if since is None or not since.prs else f" ({since.label}" + (
            f", merged {since.merged}: the first release after it" if since.release is None and since.merged else
            "") + ")"
        up = _upgrade(t, q)
        return dataclasses.replace(up, text=up.text.replace(_serve_text(q), f"serve with {engine}@{release} or "
                                                                             f"later{why}", 1), release=name)
    return None


def _some(x) -> list:
    return [] if x is None else [x]


def _every(serve: Profile, ok) -> list[Profile]:
    """Every later profile of the served line for which `ok` holds, oldest first: the replay keeps the first whose
    whole triage clears the finding, so one that opens another (a start-up refusal, say) does not end the search."""
    return [q for q in later_profiles(serve) if ok(q)]


def _wanted(t: Triage):
    train = t.align.train
    return list(train.positions) if train.resolved and train.positions else None


def _ids(t: Triage, serve: Profile, want, prefer: list[int] | None = None,
         what: str = "what training captured") -> Remedy | None:
    """Write the ids with which `serve` captures `want`, at the key it reads."""
    if not want or not serve.behaviour.config.value.keys:  # ids hard-coded in the engine: nothing to write
        return None
    ids = ids_capturing(serve, want, t.replay.num_layers, prefer=prefer)
    if ids is None:
        return None
    return Remedy(f"{write_ids_hint(serve, ids)} (captures {', '.join(map(str, want))}, {what})", tuple(ids),
                  captures=tuple(want))


def _upgrade(t: Triage, later: Profile) -> Remedy:
    """Serve with `later`, and write the ids it needs where the config's ids would capture other tensors there."""
    text = _serve_text(later)
    want, L = _wanted(t), t.replay.num_layers
    now = replay(later, read_ids(later, t.inputs.draft.raw).ids, L)
    ids = None if want is None or (now.failure is None and now.positions == want) or \
        not later.behaviour.config.value.keys else ids_capturing(later, want, L, prefer=_trained_ids(t))
    if ids is None:
        return Remedy(text, server=later)
    return Remedy(f"{text}, and {write_ids_hint(later, ids)}", tuple(ids), server=later, captures=tuple(want))


def _trained_ids(t: Triage) -> list[int] | None:
    return None if t.inputs.trained.ids is None else list(t.inputs.trained.ids)


def _serve_text(later: Profile) -> str:
    return f"serve with {later.name.split(':')[0]} or later" + \
        (f" ({later.versions.since.label})" if later.versions.since.prs else "")


# --- the plan: every change together, replayed as a whole ------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """The changes that clear every finding together (`remaining`: what the replay of all of them still finds;
    empty: nothing), the fewest that tpsim found."""

    change: Remedy
    remaining: tuple[Finding, ...]

    @property
    def clears(self) -> bool:
        return not self.remaining

    def to_dict(self) -> dict:
        return {"text": self.change.text, "change": self.change.to_dict(), "clears": self.clears,
                "remaining": [f.to_dict()["kind"] for f in self.remaining]}


def plan(t: Triage, tried: dict[str, Triage] | None = None) -> Plan | None:
    """Every finding's change merged into one (the engine version the latest of them needs, the ids that version
    needs for what training captured, every switch), applied to the inputs at once and triaged again; where the
    merge leaves findings, each version the fixes name is tried as the base, and then once more with the changes
    the findings left by the best so far ask for (an upgrade can open one: a CUDA-graph path with other ids). The
    candidate with the fewest findings left, then the fewest changes, wins. None: nothing found, or no change."""
    if not t.findings or under_torchrun():
        return None
    tried = {} if tried is None else tried
    pool = [r for i, f in enumerate(t.findings) for r in ([t.fixes[i]] if i in t.fixes else remedies_for(t, f)[:1])]
    best = _best(t, pool, tried, None)
    if best is not None and not best.clears:
        after = tried[best.change.text]
        more = [r for f in after.findings for r in remedies_for(after, f)[:1]]
        best = _best(t, pool + more, tried, best)
    return best


def _best(t: Triage, pool: list[Remedy], tried: dict[str, Triage], best: Plan | None) -> Plan | None:
    """The pool merged on the served version and on each it names, oldest first (the least disruptive upgrade)."""
    named = {r.server_name: (r.server, r.release) for r in pool if r.server is not None}
    servers = sorted(named.values(), key=lambda sr: registry.version_key(_version(sr[1] or sr[0].name)))
    for server, release in [(None, None), *servers]:
        change = _merged(t, pool, server, release)
        if change is None:
            continue
        if change.text not in tried:
            with step("replaying the plan, every change together"):
                tried[change.text] = triage(change.apply(t.inputs))
        found = Plan(change, tuple(tried[change.text].findings))
        if best is None or len(found.remaining) < len(best.remaining):
            best = found
        if found.clears:
            break
    return best


def _version(name: str) -> str:
    """`vllm@0.34.0:deepseek_v3` -> `0.34.0`."""
    return name.partition("+")[0].partition(":")[0].partition("@")[2]


def _merged(t: Triage, pool: list[Remedy], server: Profile | None, release: str | None = None) -> Remedy | None:
    """One change: `server` (None: the one served; `release`: served as that release), its ids for what training
    captured, every switch in `pool`."""
    serve, L = server or t.serve, t.replay.num_layers
    want = next((list(r.captures) for r in pool if r.captures), None) or _wanted(t)
    ids = None
    if want is not None and serve.behaviour.config.value.keys and any(r.ids is not None for r in pool):
        now = replay(serve, read_ids(serve, t.inputs.draft.raw).ids, L)
        if now.failure is not None or now.positions != want or t.config.off:
            ids = ids_capturing(serve, want, L, prefer=_trained_ids(t) or t.config.ignored)
    on, pp, radix, eagle3 = (any(getattr(r, k) for r in pool) for k in ("capture_on", "pp_off", "radix_off", "eagle3"))
    parts = [] if server is None else [f"serve with {release.partition(':')[0]} or later" if release else
                                       _serve_text(server)]
    parts += [f"serve with {FLAG[serve.engine]}"] if eagle3 else []
    parts += ["remove use_aux_hidden_state: false from eagle_config"] if on else []
    if ids is not None:
        restored = ", the ids training used, restored" if ids == _trained_ids(t) else ""
        parts.append(f"{write_ids_hint(serve, ids)} (captures {', '.join(map(str, want))}{restored})")
    parts += [f"serve without pipeline parallelism ({PP_FLAGS.get(serve.engine, '--pp')} 1)"] if pp else []
    parts += ["serve with --disable-radix-cache"] if radix and server is None else []
    if not parts:
        return None
    return Remedy(", and ".join(parts), None if ids is None else tuple(ids), server, on, pp, radix and server is None,
                  release=release, eagle3=eagle3)
