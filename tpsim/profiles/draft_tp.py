"""The draft under TP as the engines' released code builds and verifies it (issue 53): how the draft's lm_head
vocabulary is padded and split over the TP ranks (vLLM refuses a split that does not divide, SGLang pads further),
where vLLM decides per rank whether the draft shares the target's embed_tokens, and which SGLang releases and
platforms take the greedy verify branch without broadcasting the accepted tokens over TP."""

from __future__ import annotations

from dataclasses import dataclass
from tpsim.profiles.profile import Platform

from tpsim.profiles.cited import Cited, Source

VLLM, SGLANG = "vllm-project/vllm", "sgl-project/sglang"
PAD = 64  # both engines' DEFAULT_VOCAB_PADDING_SIZE

# --- 1. the draft's vocabulary split ----------------------------------------------------------------------------

VLLM_DIVIDE = Source(
    VLLM, "vllm/distributed/utils.py", "v0.32.0", "the vocab split's assert; the wheel's vllm/distributed/utils.py "
    "lines 51-55 (ensure_divisibility), called by divide (line 58) from vocab_parallel_embedding.py line 304",
    "ensure_divisibility", 'assert numerator % denominator == 0, ( f"{numerator} is not divisible by {denominator}" )')
VLLM_SPLIT = Source(
    VLLM, "vllm/model_executor/layers/vocab_parallel_embedding.py", "v0.32.0",
    "VocabParallelEmbedding.__init__ pads to padding_size (64) only, then divides by tp_size; llama_eagle3.py builds "
    "the draft's lm_head as ParallelLMHead( self.config.draft_vocab_size, ...)", "VocabParallelEmbedding.__init__",
    "self.num_embeddings_per_partition = divide( self.num_embeddings_padded, self.tp_size )")
# vllm issue #31345: in 0.32.0 only the draft-model, standalone and DSpark proposers read draft_parallel_config; the
# EAGLE proposer (v1/spec_decode/llm_base_proposer.py, eagle.py) never does, so the draft's layers take the target's
# TP group, and the config check accepts 1 or the target's TP without acting on it
VLLM_DRAFT_TP = Source(
    VLLM, "vllm/config/speculative.py", "v0.32.0", "_verify_and_get_draft_tp accepts 1 or the target's TP; no EAGLE "
    "proposer file reads draft_parallel_config (grep of the 0.32.0 wheel; vllm issue #31345)",
    "SpeculativeConfig._verify_and_get_draft_tp",
    "elif speculative_draft_tensor_parallel_size not in ( 1, target_parallel_config.tensor_parallel_size, ):")
SGLANG_SPLIT_CPU = Source(
    SGLANG, "python/sglang/srt/layers/vocab_parallel_embedding.py", "v0.5.6",
    "VocabParallelEmbedding.__init__ multiplies the padding by tp_size, on CPU only, when the padded vocabulary does "
    "not split (0.5.6 .. 0.5.21); elsewhere divide's assert refuses it", "VocabParallelEmbedding.__init__",
    "if ( _is_cpu and pad_vocab_size(self.org_vocab_size, padding_size) % self.tp_size != 0 ): "
    "padding_size *= self.tp_size", reviewed=("v0.5.21",))
SGLANG_SPLIT = Source(
    SGLANG, "python/sglang/srt/layers/vocab_parallel_embedding.py", "v0.5.22",
    "from 0.5.22 the padding grows by tp_size on every platform: the same draft starts", "VocabParallelEmbedding.__init__",
    "if pad_vocab_size(self.org_vocab_size, padding_size) % self.tp_size != 0: padding_size *= self.tp_size",
    reviewed=("v0.5.23",))
SGLANG_DIVIDE = Source(SGLANG, "python/sglang/srt/distributed/utils.py", "v0.5.6", "the split's assert",
                       "ensure_divisibility",
                       'assert numerator % denominator == 0, "{} is not divisible by {}".format( numerator, denominator )')
SGLANG_PADS_EVERYWHERE = "0.5.22"


@dataclass(frozen=True)
class VocabSplit:
    """How an engine version pads the draft's `draft_vocab_size` rows before splitting them over TP."""

    engine: str
    pads_by_tp: Cited[bool]  # True: the padding grows to PAD * tp when PAD alone does not split

    def rows(self, vocab: int, tp: int) -> int:
        pad = PAD * tp if self.pads_by_tp.value and (-(-vocab // PAD) * PAD) % tp else PAD
        return -(-vocab // pad) * pad

    def refusal(self, vocab: int, tp: int) -> str | None:
        """The engine's own words when it does not start (None: it splits)."""
        rows = self.rows(vocab, tp)
        return None if rows % tp == 0 else f"AssertionError: {rows} is not divisible by {tp}"


def vocab_split(engine: str, pads_everywhere: bool, cpu: bool) -> VocabSplit:
    """`engine` (`pads_everywhere`: an SGLang at SGLANG_PADS_EVERYWHERE or later) on a CPU (`cpu`) or elsewhere."""
    if engine == "vllm":
        return VocabSplit(engine, Cited(False, VLLM_SPLIT))
    if pads_everywhere:
        return VocabSplit(engine, Cited(True, SGLANG_SPLIT))
    return VocabSplit(engine, Cited(cpu, SGLANG_SPLIT_CPU))


# --- 2. the embed_tokens verdict, per rank ---------------------------------------------------------------------

VLLM_VERDICT = Source(
    VLLM, "vllm/v1/spec_decode/llm_base_proposer.py", "v0.32.0",
    "_maybe_share_embeddings compares each rank's own vocab shard of the target's embed_tokens with its shard of the "
    "draft's, and acts on that verdict alone (no collective): vllm issue #50158 (v0.26.0, TP 2: rank 0 kept, rank 1 "
    "shared); PR #50280 (open, no release) takes a MIN over the TP group first",
    "SpecDecodeBaseProposer._maybe_share_embeddings",
    "and torch.equal( target_embed_tokens.weight.cpu(), self.model.model.embed_tokens.weight.cpu(), ) ): "
    "share_embeddings = True")
VLLM_SHARE = Source(VLLM, "vllm/v1/spec_decode/llm_base_proposer.py", "v0.32.0",
                    "a rank whose verdict is equal replaces its draft's embed_tokens module by the target's",
                    "SpecDecodeBaseProposer._maybe_share_embeddings",
                    "if share_embeddings: if hasattr(self.model.model, \"embed_tokens\"): "
                    "del self.model.model.embed_tokens self.model.model.embed_tokens = target_embed_tokens")
PR_50280 = "vllm-project/vllm PR #50280 (open, in no release read), which takes a MIN of the ranks' verdicts first"

# --- 3. SGLang's greedy verify and the TP broadcast ----------------------------------------------------------------


EAGLE_UTILS = "python/sglang/srt/speculative/eagle_utils.py"


@dataclass(frozen=True)
class VerifyBranch:
    """One interval of SGLang releases' `eagle_sample`: the platforms that always take the greedy branch (CUDA takes
    it when every request is greedy) and those whose greedy branch broadcasts the verify decision from TP rank 0."""

    since: str
    greedy: frozenset[Platform]
    broadcast: frozenset[Platform]
    source: Source


def _branch(since: str, greedy: str, broadcast: str, quote: str, note: str = "") -> VerifyBranch:
    def platforms(s: str) -> frozenset[Platform]:
        return frozenset(Platform(p) for p in s.split())
    return VerifyBranch(since, platforms(greedy), platforms(broadcast),
                        Source(SGLANG, EAGLE_UTILS, f"v{since}", note, "eagle_sample", quote))


HIP_BROADCAST = ("if _is_hip: # On ROCm, the per-rank draft tokens can differ, so ranks accept a # different number of "
                 "drafts, desynchronize the committed seq_lens, and # deadlock the next TP collective.")
VERIFY_BRANCHES = (  # the first release of each interval; eagle_sample is first in eagle_utils.py in 0.5.14
    _branch("0.5.14", "npu hip", "", "if sampling_info.is_all_greedy or _is_npu or _is_hip:"),
    _branch("0.5.15", "npu hip xpu", "", "if sampling_info.is_all_greedy or _is_npu or _is_hip or _is_xpu:"),
    _branch("0.5.16", "cpu npu hip xpu", "", "if sampling_info.is_all_greedy or _is_cpu or _is_npu or _is_hip or _is_xpu:"),
    _branch("0.5.18", "cpu npu hip xpu", "hip", HIP_BROADCAST, "PR #34238: the greedy branch broadcasts on ROCm only"),
    _branch("0.5.20", "cpu hip xpu", "hip", "if sampling_info.is_all_greedy or _is_cpu or _is_hip or _is_xpu:"),
    _branch("0.5.21", "cpu hip xpu", "hip", "if _verify_uses_greedy( is_all_greedy=sampling_info.is_all_greedy, "
            "is_cpu=_is_cpu, is_hip=_is_hip, is_xpu=_is_xpu,",
            "HIP goes greedy only without --speculative-use-rejection-sampling (_verify_uses_greedy)"),
)
OLDEST_VERIFY, NEWEST_VERIFY = VERIFY_BRANCHES[0].since, "0.5.23"
PR_31478 = "sgl-project/sglang PR #31478 (open, in no release read)"
