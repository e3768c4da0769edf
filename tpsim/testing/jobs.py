"""Test jobs: run one layer or the whole model at a TP degree and return every rank's output.

`sabotage` injects a deliberate sharding bug for the negative control:
- "wrong_shard": layer 0's o_proj loads the next rank's input slice;
- "bias_every_rank": layer 0's o_proj partial sum gets a bias on every rank before the reduce.
"""

from __future__ import annotations

import ctypes
import os
import signal
from dataclasses import replace
from pathlib import Path

import torch

from tpsim.capture import Position, Recorder
from tpsim.weights.reader import Checkpoint, load_weights
from tpsim.config.loader import config_from_dict
from tpsim.base.tensors import bitwise_equal
from tpsim.run.jobs import (DTYPES, agree_on_run, build_model, own_tokens, prefill_cache, routing_rows,
                            run_captured, run_recorded, run_captured_parts)
from tpsim.model.decoder import CausalLM
from tpsim.modes import Mode, SequenceParallel, Strategy, TensorParallel
from tpsim.layers import (GQA, MLA, AttentionShape, ColumnParallelLinear, DenseMLP, MergedColumnParallelLinear, MoE, ParallelLMHead,
                          RowParallelLinear, VocabParallelEmbedding)
from tpsim.parallel.consistency import agree
from tpsim.parallel.launch import RankContext
from tpsim.run.spec import RunSpec
from tpsim.weights.seeded import init_random_weights, init_tensor
from tpsim.parallel.ops import Op


def layer_input(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed ^ 0xACE)
    return torch.randn(shape, generator=g).to(dtype)


def make_layer(kind: str, cfg, group, dtype):
    H = cfg.hidden_size
    if kind == "embedding":
        return VocabParallelEmbedding(cfg.vocab_size, H, group, "model.embed_tokens", dtype)
    if kind == "lm_head":
        return ParallelLMHead(cfg.vocab_size, H, group, "lm_head", dtype)
    if kind == "column":
        return ColumnParallelLinear(H, cfg.intermediate_size, group, "col", dtype, bias=True)
    if kind == "merged":
        return MergedColumnParallelLinear(H, [cfg.intermediate_size, cfg.intermediate_size], group, "mlp.gate_up_proj",
                                          dtype, hf_names=["mlp.gate_proj.weight", "mlp.up_proj.weight"])
    if kind == "row":
        return RowParallelLinear(cfg.intermediate_size, H, group, "row", dtype, bias=True)
    if kind == "mlp":
        return DenseMLP(H, cfg.intermediate_size, group, "model.layers.0.mlp", dtype)
    if kind == "mla":
        return MLA(cfg, group, "model.layers.0.self_attn", dtype)
    if kind == "moe":
        return MoE(cfg, group, "model.layers.0.mlp", dtype)
    raise ValueError(kind)


def embedding_ids(cfg, seed: int, T: int, tp: int) -> torch.Tensor:
    """T seeded random ids, then the first and the last real id of every rank's vocab slice at
    TP=tp: an off-by-one at a slice boundary (`>= end` written `> end`) shows on exactly those."""
    g = torch.Generator().manual_seed(seed)
    n = cfg.padded_vocab_size // tp
    edges = [i for r in range(tp) if r * n < cfg.vocab_size for i in (r * n, min((r + 1) * n, cfg.vocab_size) - 1)]
    return torch.cat([torch.randint(0, cfg.vocab_size, (T,), generator=g), torch.tensor(edges, dtype=torch.long)])


def run_layer(kind: str, cfg, group, seed: int, dtype: str, T: int) -> torch.Tensor:
    """One layer with seeded weights on a seeded input (ids for the embedding, `[T, in]` otherwise)."""
    dt = DTYPES[dtype]
    layer = make_layer(kind, cfg, group, dt)
    init_random_weights(layer, seed)
    if kind == "embedding":
        return layer(embedding_ids(cfg, seed, T, group.size))
    width = cfg.intermediate_size if kind == "row" else cfg.hidden_size
    x = layer_input(seed, (T, width), dt)
    if kind == "row":  # the row-parallel layer takes this rank's slice of the input
        x = x.chunk(group.size, dim=-1)[group.rank]
    if kind == "mla":
        return layer(torch.arange(T), x)
    return layer(x)


def layer_job(ctx: RankContext, kind: str, cfg: dict, seed: int, dtype: str, T: int, tp: int):
    if not ctx.participates(tp):
        return None
    group = ctx.groups[tp]
    group.tracer.clear()
    return {"out": run_layer(kind, config_from_dict(cfg), group, seed, dtype, T),
            "all_reduces": group.tracer.count(Op.ALL_REDUCE), "all_gathers": group.tracer.count(Op.ALL_GATHER)}


def gqa_job(ctx: RankContext, shape: dict, seed: int, T: int, tp: int):
    """One GQA layer with seeded weights on a seeded input: its output, and this rank's K and V
    weight rows with the KV head they are (for the replication check)."""
    if not ctx.participates(tp):
        return None
    group = ctx.groups[tp]
    group.tracer.clear()
    layer = GQA(AttentionShape(**shape), group, "model.layers.0.self_attn", torch.float32)
    init_random_weights(layer, seed)
    out = layer(torch.arange(T), layer_input(seed, (T, shape["hidden_size"]), torch.float32))
    qkv = layer.qkv_proj
    _, k, v = qkv.weight.split([qkv.heads * qkv.head_dim, qkv.kv_heads * qkv.head_dim, qkv.kv_heads * qkv.head_dim])
    return {"out": out, "k": k.clone(), "v": v.clone(), "kv_shard": qkv.kv_shard, "kv_heads": qkv.kv_heads,
            "all_reduces": group.tracer.count(Op.ALL_REDUCE)}


def sigint_job(ctx: RankContext) -> dict:
    """How this rank treats SIGINT: blocked since it started (the launcher's mask at the fork) and ignored."""
    return {"blocked": signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []),
            "ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}


PR_GET_PDEATHSIG = 2


def rank_facts_job(ctx: RankContext, name: str) -> dict:
    """What a started rank is, whatever started it: the launcher's value of environment variable
    `name`, its name in ps, the signal it gets when its parent dies, its handlers, its threads."""
    sig = ctypes.c_int(0)
    ctypes.CDLL("libc.so.6").prctl(PR_GET_PDEATHSIG, ctypes.byref(sig))
    return {"env": os.environ.get(name), "comm": Path("/proc/self/comm").read_text().strip(),
            "death_signal": sig.value, "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "torch_threads": torch.get_num_threads(), "pid": os.getpid()}


def _sabotage(model, how: str, seed: int) -> None:
    o_proj = model.model.layers[0].self_attn.o_proj
    g = model.group
    if how == "wrong_shard":
        other = (g.rank + 1) % g.size
        for spec in o_proj.weight_specs():
            full = init_tensor(seed, spec.name, spec.shape)
            with torch.no_grad():
                o_proj.weight.copy_(full.narrow(1, other * o_proj.in_per_rank, o_proj.in_per_rank))
    elif how == "bias_every_rank":
        bias = 0.1 * torch.ones(o_proj.out_features, dtype=o_proj.weight.dtype)
        o_proj.forward = lambda x: _biased(x, bias, o_proj)
    else:
        raise ValueError(how)


def _biased(x, bias, o_proj):
    """The classic bug: the bias is added to every rank's partial sum, i.e. tp times after the reduce."""
    y = torch.nn.functional.linear(x, o_proj.weight) + bias
    return o_proj.group.all_reduce(y, o_proj.prefix)


def model_job(ctx: RankContext, cfg: dict, seed: int, dtype: str, input_ids: list[int], positions: list[str],
              tp: int, sabotage: str | None = None, checkpoint: str | None = None):
    """Every group rank's capture `[T, n * hidden]`, its logits, and its all-reduce count
    (weights seeded from `seed`, or read from the `checkpoint` directory)."""
    if not ctx.participates(tp):
        return None
    config = config_from_dict(cfg)
    group = ctx.groups[tp]
    model = build_model(config, group, seed, dtype, checkpoint)
    if sabotage:
        _sabotage(model, sabotage, seed)
    pos = [Position.parse(p, config.num_hidden_layers) for p in positions]
    capture, logits = run_captured(model, input_ids, pos)
    return {"capture": capture, "logits": logits, "all_reduces": group.tracer.count(Op.ALL_REDUCE),
            "all_gathers": group.tracer.count(Op.ALL_GATHER), "routing": routing_rows(model)}


def fault_job(ctx: RankContext, rank: int, how: str):
    """Rank `rank` raises ("raise") or dies without a word ("die"); the others wait in a
    collective on the world group, as ranks do when a peer fails mid-forward."""
    if ctx.rank == rank:
        if how == "die":
            os._exit(7)
        raise RuntimeError(f"injected fault on rank {rank}")
    group = ctx.groups[ctx.world_size]
    return group.all_reduce(torch.ones(1), "fault_job").item()


def report_job(ctx: RankContext, reports: dict):
    """Rank r sleeps reports[r][0] seconds, then raises RuntimeError(reports[r][1]), or stalls
    forever when that message is None; ranks not in `reports` return. This fixes the order in
    which the launcher hears of failures, as a race between ranks may."""
    import time
    if ctx.rank not in reports:
        return ctx.rank
    delay, message = reports[ctx.rank]
    time.sleep(delay)
    while message is None:
        time.sleep(3600)
    raise RuntimeError(message)


def load_job(ctx: RankContext, cfg: dict, dtype: str, checkpoint: str, tp: int, seed: int | None = None,
             reference: str | None = None):
    """Load `checkpoint` at TP=tp and compare every parameter bitwise with the seeded model
    (`seed`) or with loading the `reference` directory. Per rank: the names that differ, the
    elements read from the files, and the elements this rank's parameters hold."""
    if not ctx.participates(tp):
        return None
    config, group = config_from_dict(cfg), ctx.groups[tp]
    ckpt = Checkpoint(checkpoint)
    model = CausalLM(config, group, DTYPES[dtype])
    load_weights(model, ckpt)
    expected = build_model(config, group, seed, dtype, reference)
    theirs = dict(expected.named_parameters())
    differ = [n for n, p in model.named_parameters() if not bitwise_equal(p, theirs[n])]
    return {"differ": differ, "elements_read": ckpt.elements_read,
            "local_elements": sum(p.numel() for p in model.parameters())}


def slow_job(ctx: RankContext, seconds: float, report_every: float | None):
    """Work for `seconds` without a collective, reporting progress every `report_every` s (or never)."""
    import time
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(report_every or 0.1)
        if report_every:
            ctx.progress("still working")
    return ctx.rank


def busy_job(ctx: RankContext, seconds: float):
    """Compute for `seconds` of this rank's CPU time without a word or a collective (a long forward)."""
    import time
    end = time.process_time() + seconds
    x = torch.ones(64, 64)
    while time.process_time() < end:
        x = (x @ x).clamp_(-1, 1)
    return ctx.rank


def disagree_job(ctx: RankContext, field: str, from_rank: int):
    """Ranks >= from_rank start with a different `field` (as a torchrun rank given other
    arguments would); the consistency check must stop every rank before any forward."""
    fields = {"config": {"hidden_size": 64}, "input ids": [1, 2, 3], "weights": {"seed": 0}}
    if ctx.rank >= from_rank:
        fields[field] = {"changed on rank": ctx.rank >= from_rank}
    agree(ctx.world_size, fields)
    return "ran"


RUN_CHANGES = {  # one field of a run, changed as a torchrun rank given other arguments or files would see it
    "config": lambda s: replace(s, source=replace(s.source, cfg=replace(s.cfg, rms_norm_eps=s.cfg.rms_norm_eps * 2))),
    "weights": lambda s: replace(s, seed=s.seed + 1),
    "input ids": lambda s: replace(s, tokens=s.tokens[::-1]),
    "dtype": lambda s: replace(s, dtype="bfloat16"),
    "mode": lambda s: replace(s, mode=SequenceParallel()),
    "capture spec": lambda s: replace(s, positions=s.positions[:-1]),
}


def run_disagree_job(ctx: RankContext, spec: RunSpec, field: str, from_rank: int):
    """agree_on_run, with ranks >= from_rank holding a spec changed in `field` (RUN_CHANGES)."""
    if ctx.rank >= from_rank:
        spec = RUN_CHANGES[field](spec)
    agree_on_run(ctx, spec, {"positions": [str(p) for p in spec.positions]})
    return "ran"


def param_bytes_job(ctx: RankContext, cfg: dict, dtype: str, tp: int):
    """The bytes of this rank's parameters in a real model at TP=tp (for the memory guard's estimate)."""
    if not ctx.participates(tp):
        return None
    model = CausalLM(config_from_dict(cfg), ctx.groups[tp], DTYPES[dtype])
    return sum(p.numel() * p.element_size() for p in model.parameters())


def mismatch_job(ctx: RankContext, case: str):
    """Rank 1 enters an all-reduce with another shape or dtype than rank 0 (a sharding bug)."""
    group = ctx.groups[ctx.world_size]
    x = torch.ones(4)
    if ctx.rank == 1:
        x = torch.ones(6) if case == "shape" else torch.ones(4, dtype=torch.float64)
    return group.all_reduce(x, "mismatch_job").tolist()


def _float32_model(ctx: RankContext, cfg: dict, seed: int, positions: list[str], tp: int, mode: Mode):
    """The opening every whole-model job shares: None on a rank outside the TP=tp block, else
    (this rank's float32 model in `mode`, its group, the parsed capture positions)."""
    if not ctx.participates(tp):
        return None
    config, group = config_from_dict(cfg), ctx.groups[tp]
    model = build_model(config, group, seed, "float32", mode=mode)
    return model, group, [Position.parse(p, config.num_hidden_layers) for p in positions]


def _in_mode(ctx: RankContext, cfg: dict, seed: int, input_ids: list[int], positions: list[str], tp: int,
             mode: dict):
    """_float32_model in the mode a `Mode.to_dict()` names, with the tokens this rank feeds: None on a
    rank outside the TP=tp block, else (mode, model, group, positions, this rank's token ids)."""
    m = Mode.from_dict(mode)
    run = _float32_model(ctx, cfg, seed, positions, tp, m)
    if run is None:
        return None
    model, group, pos = run
    return m, model, group, pos, own_tokens(input_ids, m, group)


def mode_job(ctx: RankContext, cfg: dict, seed: int, input_ids: list[int], positions: list[str], tp: int,
             mode: dict, strategies: list[Strategy]):
    """One float32 model at TP=tp in `mode`, one forward per capture strategy. Per group rank:
    {strategy: this rank's capture per position}, the logits, the model's collectives of the
    last forward (op, caller; the capture's own gathers left out; `collective_bytes`: the same
    as (op, bytes of this rank's input)) and the routing of every MoE layer over all T tokens in
    order ([T, top_k] sorted; gathered from the ranks under ep)."""
    run = _in_mode(ctx, cfg, seed, input_ids, positions, tp, mode)
    if run is None:
        return None
    m, model, group, pos, ids = run
    caps = {}
    for s in strategies:
        parts, logits = run_captured_parts(model, ids, pos, s)
        caps[s] = [p.clone() for p in parts]
    model_records = [r for r in group.tracer.records if not r.caller.startswith("capture.")]
    route = routing_rows(model, m, group, len(input_ids))
    if m.runs_own_tokens(tp):  # every rank's rows, in rank order
        every = group.all_gather_object({k: v.cpu() for k, v in route.items()}, "check.routing_rows")
        route = {k: torch.cat([e[k] for e in every]) for k in route}
    return {"captures": caps, "logits": logits, "routing": route,
            "collectives": [(r.op, r.caller) for r in model_records],
            "collective_bytes": [(r.op, r.bytes) for r in model_records]}


def aliasing_job(ctx: RankContext, cfg: dict, seed: int, input_ids: list[int], positions: list[str], tp: int,
                 mode: dict):
    """Per group rank: the in-layer capture cloned and uncloned (the residual updated in place),
    each forward's logits, and the uncloned recorder's `modified` list as strings."""
    run = _in_mode(ctx, cfg, seed, input_ids, positions, tp, mode)
    if run is None:
        return None
    _, model, group, pos, ids = run
    uncloned, logits_u = run_recorded(model, ids, pos, Strategy.IN_LAYER_UNCLONED)
    cloned, logits_c = run_recorded(model, ids, pos, Strategy.IN_LAYER)
    return {"uncloned": uncloned.parts(), "cloned": cloned.parts(), "logits": (logits_u, logits_c),
            "modified": [(str(p), None if now is None else str(now)) for p, now in uncloned.modified()]}


def gptoss_moe_job(ctx: RankContext, shape: dict, seed: int, T: int, tp: int, ep: bool = False):
    """One GPT-OSS MoE block (tpsim.layers.gptoss) with seeded weights on a seeded input `[T, hidden]`:
    its output (under EP: this rank's contiguous token shard's), the experts each token picked, the
    routing margins and the all-reduce count."""
    from tpsim.layers.gptoss import GptOssMoE, GptOssMoEShape
    if not ctx.participates(tp):
        return None
    group = ctx.groups[tp]
    group.tracer.clear()
    layer = GptOssMoE(GptOssMoEShape(**shape), group, "model.layers.0.mlp", torch.float32, expert_parallel=ep)
    init_random_weights(layer, seed)
    x = layer_input(seed, (T, shape["hidden_size"]), torch.float32)
    if ep:
        x = x.tensor_split(tp)[group.rank]
    out = layer(x)
    return {"out": out, "ids": layer.routing.ids, "margin": layer.routing.margin,
            "all_reduces": group.tracer.count(Op.ALL_REDUCE)}


def sink_attention_job(ctx: RankContext, heads: int, kv_heads: int, head_dim: int, T: int, window: int | None,
                       seed: int, tp: int):
    """sink_attention on this rank's heads of seeded q/k/v `[T, heads, d]` (KV heads split or
    replicated as QKVParallelLinear holds them), with its AttentionSinks slice of seeded sinks."""
    from tpsim.layers.gptoss import AttentionSinks
    if not ctx.participates(tp):
        return None
    group = ctx.groups[tp]
    sinks = AttentionSinks(heads, group, "model.layers.0.self_attn")
    init_random_weights(sinks, seed)
    q = layer_input(seed, (T, heads, head_dim), torch.float32)
    k, v = (layer_input(seed + i, (T, kv_heads, head_dim), torch.float32) for i in (1, 2))
    h = heads // tp
    kv_shard, kv_local = (group.rank // (tp // kv_heads), 1) if tp >= kv_heads else (group.rank, kv_heads // tp)
    kv = slice(kv_shard * kv_local, (kv_shard + 1) * kv_local)
    return {"out": sinks(q[:, group.rank * h:(group.rank + 1) * h], k[:, kv], v[:, kv], window),
            "sinks": sinks.sinks.detach().clone()}


def tbo_job(ctx: RankContext, cfg: dict, seed: int, input_ids: list[int], positions: list[str], tp: int):
    """One float32 model at TP=tp under two-batch overlap (pure TP), two forwards: the engine's capture
    (model-level: SGLang's capture loop) and the micro-batches fix. Per group rank: {strategy: this rank's
    capture per captured position}, the engine recorder's missing positions, each forward's logits, the
    routing of every MoE layer over all T tokens, and the model's collective ops of the last forward."""
    run = _float32_model(ctx, cfg, seed, positions, tp, TensorParallel(tbo=True))
    if run is None:
        return None
    model, group, pos = run
    engine, logits_e = run_recorded(model, input_ids, pos, Strategy.MODEL_LEVEL)
    fixed, logits_f = run_recorded(model, input_ids, pos, Strategy.MICRO_BATCHES)
    return {"engine": engine.parts(), "missing": [str(p) for p in engine.missing()], "fixed": fixed.parts(),
            "logits": (logits_e, logits_f), "routing": routing_rows(model),
            "collectives": [r.op for r in group.tracer.records if not r.caller.startswith("capture.")]}


def prefix_cache_job(ctx: RankContext, cfg: dict, seed: int, input_ids: list[int], positions: list[str], tp: int,
                     mode: dict, n: int, other: list[int]):
    """One float32 model at TP=tp in `mode`, four forwards of this rank: the whole prompt; its first n
    tokens filling a PrefixCache, then the rest after them; the rest at the same positions with no cache;
    the rest after a cache filled from the prefix `other`. Per group rank: each forward's capture per
    position and logits ({"full", "cached", "uncached", "other"}), each one's routing of every MoE layer,
    the cached forward's model collectives (op) and the cache's stored KV shapes by caller."""
    run = _in_mode(ctx, cfg, seed, input_ids, positions, tp, mode)
    if run is None:
        return None
    m, model, group, pos, ids = run
    out = {"full": run_captured_parts(model, ids, pos, m.right_strategy), "routing": {"full": routing_rows(model)}}
    cache, suffix = prefill_cache(model, ids, n)
    out["cached"] = run_captured_parts(model, suffix, pos, m.right_strategy, cache)
    out["routing"]["cached"] = routing_rows(model)
    out["collectives"] = [r.op for r in group.tracer.records if not r.caller.startswith("capture.")]
    out["stored"] = {caller: tuple(kv.shape) for caller, kv in cache.kv.items()}
    recorder = Recorder(pos, m.right_strategy)
    with model.probe.attach(recorder):
        logits = model(torch.tensor(suffix, dtype=torch.long), torch.arange(n, len(ids)))
    out["uncached"] = (recorder.parts(), logits)
    elsewhere, _ = prefill_cache(model, other + ids[n:], n)
    out["other"] = run_captured_parts(model, suffix, pos, m.right_strategy, elsewhere)
    return out
