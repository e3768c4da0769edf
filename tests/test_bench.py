"""tpsim.bench.overhead_job on real gloo ranks: the shape of what it returns."""

from pathlib import Path

from tpsim.capture import resolve
from tpsim.config import load_config
from tpsim.parallel.launch import RankPool

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def test_overhead_job_structure():
    cfg = load_config(TINY)
    L = cfg.num_hidden_layers
    positions = [str(p) for p in resolve("sglang", None, L).positions]
    repeats = 2
    with RankPool(2) as pool:
        for tp in (1, 2):
            results = pool.run("tpsim.bench:overhead_job", cfg=cfg.to_dict(), seed=0, dtype="float32", seq_len=8,
                               positions=positions, tp=tp, warmup=1, repeats=repeats)
            assert set(results) == {0, 1}
            ranks = [r for r in results.values() if r is not None]
            assert len(ranks) == tp
            if tp == 1:
                assert results[1] is None  # rank 1 is outside the first TP=1 block
            for r in ranks:
                assert r["tp"] == tp
                for key in ("with_capture_s", "without_capture_s"):
                    assert len(r[key]) == repeats
                    assert all(isinstance(s, float) and s > 0 for s in r[key])
                assert r["all_reduces"] == (1 + 2 * L if tp == 2 else 0)
                # each all-reduce moves one [T, hidden] float32 tensor (embedding, o_proj, MLP/MoE)
                assert r["all_reduce_bytes"] == (1 + 2 * L) * 8 * cfg.hidden_size * 4 * (tp == 2)
                assert r["same_collectives"]
            if tp == 2:
                assert ranks[0]["all_reduce_bytes"] == ranks[1]["all_reduce_bytes"]
