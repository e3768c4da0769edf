"""The EAGLE-3 draft loaders of SGLang and vLLM as data (tpsim/profiles/loaders.py says what the fields mean).

Read from the released wheels on PyPI, the file named in each source at the release in its ref:
SGLang `python/sglang/srt/models/llama_eagle3.py` in 0.5.6, 0.5.7, 0.5.8, 0.5.9, 0.5.10, 0.5.11, 0.5.12, 0.5.16,
0.5.17 and 0.5.23 (and the eagle worker that hands the draft the target's embedding); vLLM
`vllm/model_executor/models/llama_eagle3.py` and the proposer's embedding sharing in 0.11.0, 0.11.1, 0.11.2,
0.12.0, 0.13.0, 0.14.0, 0.17.1, 0.18.0, 0.21.0, 0.22.0, 0.23.0, 0.24.0 and 0.34.0. A change's release is the first
wheel read that has it, the one before it read too (so the boundary is exact); releases between two read wheels
that agree are taken to agree. PRs are named where the code matches the PR's description; a change whose PR was
not found names none. The layout of the draft read is SpecForge's (config.json with `architectures:
["LlamaForCausalLMEagle3"]`), not the speculators format (whose config vLLM rewrites in
transformers_utils/configs/speculators/algos.py).
"""

from __future__ import annotations

from dataclasses import replace

from tpsim.base.errors import UsageError
from tpsim.profiles import registry
from tpsim.profiles.loaders import AuxCount, EmbedUse, Fate, Loader, LoaderLine, ServedLoader, Use
from tpsim.profiles.cited import Change, Cited, Source

SG, VL = "sgl-project/sglang", "vllm-project/vllm"
SG_FILE = "python/sglang/srt/models/llama_eagle3.py"
VL_FILE = "vllm/model_executor/models/llama_eagle3.py"
MIDLAYER = frozenset(f"midlayer.{n}.weight" for n in (
    "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
    "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
READS = MIDLAYER | {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}


def sg(ref: str, symbol: str, quote: str, note: str, path: str = SG_FILE, reviewed: tuple[str, ...] = ()) -> Source:
    return Source(SG, path, ref, note, symbol, quote, reviewed)


def vl(ref: str, symbol: str, quote: str, note: str, path: str = VL_FILE, reviewed: tuple[str, ...] = ()) -> Source:
    return Source(VL, path, ref, note, symbol, quote, reviewed)


def _no_norm_keys(source: Source) -> dict[str, Cited]:
    """A loader that reads none of norm_before_fc (top-level or nested), fc_norm and norm_output, as `source` shows."""
    return {"norm_before_fc": Cited(Use.IGNORED, source), "fc_norm": Cited(Use.IGNORED, source),
            "norm_output": Cited(Use.IGNORED, source), "nested_norm_before_fc": Cited(False, source)}


# --- SGLang ------------------------------------------------------------------------------------------------------

SG_SKIPS = sg("v0.5.6", "LlamaForCausalLMEagle3.load_weights",
              'param_name = name if name in params_dict else f"model.{name}" if param_name in params_dict:',
              "a name the model has no parameter for (with or without `model.`) is passed over: no error, no log; "
              "d2t becomes hot_token_id = d2t + arange, t2d is skipped; the same test in 0.5.23",
              reviewed=("v0.5.12", "v0.5.17", "v0.5.23"))
SG_NO_NORMS = sg("v0.5.6", "LlamaModel.__init__", "self.fc = torch.nn.Linear( self.hidden_size_in * 3, "
                 "config.hidden_size, bias=getattr(config, \"bias\", False), )",
                 "no norm key of the config is read before 0.5.12: fc takes the raw capture, the next step the "
                 "pre-norm hidden (hidden_states_to_aux); fc_norm and norm_output absent from 0.5.6 .. 0.5.11; fc is "
                 "built whatever eagle_config.use_aux_hidden_state says (the file never reads it, 0.5.6 .. 0.5.23)")
SG_RESIDUAL = sg("v0.5.23", "LlamaDecoderLayer.forward", "residual = hidden_states",
                 "the input layer takes the residual before hidden_norm in every release read (0.5.6 .. 0.5.23); "
                 "norm_before_residual is read nowhere in the file", reviewed=("v0.5.6", "v0.5.12", "v0.5.17"))
SG_3134 = sg("v0.5.17", "LlamaModel.__init__", 'self.norm_before_fc = bool( eagle_config.get("norm_before_fc", '
             'getattr(config, "norm_before_fc", False)) ) if self.norm_before_fc: self.input_norm = RMSNorm(',
             "PR #32334 (merged 2026-07-24, 'Honor EAGLE3 norm_before_fc'): first in 0.5.17, absent from 0.5.16; "
             "eagle_config.norm_before_fc first, then the top-level key", reviewed=("v0.5.23",))
SG_31 = sg("v0.5.12", "LlamaModel.__init__", 'use_fc_norm = getattr(config, "fc_norm", None) or getattr( config, '
           '"use_aux_norm", False ) ... self.norm_output = getattr(config, "norm_output", False)',
           "fc_norm (one RMSNorm per aux chunk, fc_norm.N) and norm_output (the normed hidden fed back) first in "
           "0.5.12, absent from 0.5.11; the PR that added them was not pinned down; norm_before_fc still read nowhere "
           "(to 0.5.16)", reviewed=("v0.5.16", "v0.5.23"))
SG_EMBED = sg("v0.5.6", "LlamaForCausalLM.set_embed", "def set_embed(self, embed): # NOTE: If draft hidden size != "
              "target hidden size, the embed weight cannot be shared for EAGLE3 if ( hasattr(self.config, "
              '"target_hidden_size") and self.config.target_hidden_size != self.config.hidden_size ): return del '
              "self.model.embed_tokens.weight self.model.embed_tokens.weight = embed",
              "the EAGLE-3 draft (LlamaForCausalLMEagle3 inherits this set_embed) is given the target's embedding by "
              "the worker (eagle_worker.py EAGLEWorker.__init__: `self.draft_model_runner.model.set_embed(embed)`; "
              "0.5.23: eagle_worker_common.py, the same call), except where its config's target_hidden_size is not "
              "its hidden_size: then set_embed returns early and the draft runs on its own embed_tokens, "
              "uninitialised when the checkpoint has none",
              path="python/sglang/srt/models/llama.py", reviewed=("v0.5.23",))

SG_THREE = sg("v0.5.11", "LlamaModel.__init__", "if hasattr(config, \"target_hidden_size\"): self.hidden_size_in = "
              "config.target_hidden_size ... self.fc = torch.nn.Linear( self.hidden_size_in * 3,",
              "fc is built for three aux states whatever the config says (0.5.6 .. 0.5.11): a draft whose fc.weight "
              "takes another count fails to load (the checkpoint's shape is not the parameter's)",
              reviewed=("v0.5.6",))
SG_24663 = sg("v0.5.12", "LlamaModel.__init__", 'self.num_aux_hidden_states = getattr(config, "num_aux_hidden_states", '
              'None) ... len(layer_ids) if layer_ids else 3',
              "PR #24663 (Support newer EAGLE-3 drafters): first in 0.5.12, absent from 0.5.11; fc takes "
              "target_hidden_size x num_aux_hidden_states (else the number of eagle_config's layer ids, else 3); "
              "the same in 0.5.23", reviewed=("v0.5.23",))

SGLANG = LoaderLine(
    "sglang", SG_FILE, "0.5.6", "0.5.23", Cited(READS, SG_SKIPS),
    Loader(unknown=Cited(Fate.SKIPPED, SG_SKIPS), **_no_norm_keys(SG_NO_NORMS),
           norm_before_residual=Cited(Use.IGNORED, SG_RESIDUAL), idle_input_norm=Cited(Fate.SKIPPED, SG_SKIPS),
           aux_off_fc=Cited(Fate.READ, SG_NO_NORMS), embed=Cited(EmbedUse.TARGETS_UNLESS_WIDTHS, SG_EMBED),
           aux_count=Cited(AuxCount.THREE, SG_THREE)),
    (Change(("#24663",), "fc_norm and norm_output read; fc sized by num_aux_hidden_states", None, "0.5.12",
            {"fc_norm": Cited(Use.HONOURED, SG_31), "norm_output": Cited(Use.HONOURED, SG_31),
             "norm_before_fc": Cited(Use.IGNORED, SG_31), "aux_count": Cited(AuxCount.FROM_CONFIG, SG_24663)}),
     Change(("#32334",), "Fix GPT-OSS EAGLE3 hidden states (norm_before_fc honoured)", None, "0.5.17",
            {"norm_before_fc": Cited(Use.HONOURED, SG_3134), "nested_norm_before_fc": Cited(True, SG_3134)})))

# --- vLLM --------------------------------------------------------------------------------------------------------

VL_REFUSES = vl("v0.11.0", "LlamaModel.load_weights", "if 'midlayer.' in name: name = name.replace('midlayer.', "
                "'layers.0.') ... param = params_dict[name]",
                "a name the draft has no parameter for raises KeyError (0.34.0: AutoWeightsLoader raises \"There is "
                "no module or parameter named ...\"); d2t is renamed draft_id_to_target_id, t2d skipped, names get "
                "`model.` unless lm_head", reviewed=("v0.18.0", "v0.22.0", "v0.34.0"))
VL_RESIDUAL = vl("v0.11.0", "LlamaDecoderLayer.__init__", 'if getattr(config, "norm_before_residual", False): '
                 "self._residual_norm = self._norm_before_residual",
                 "honoured in every release read (0.11.0 .. 0.34.0)", reviewed=("v0.18.0", "v0.34.0"))
VL_NO_NORMS = vl("v0.17.1", "LlamaModel.__init__", "self.fc = ReplicatedLinear( input_size=fc_input_size,",
                 "norm_before_fc absent before 0.18.0 (0.17.1 read), fc_norm and norm_output before 0.22.0 (0.21.0 "
                 "read): fc takes the raw capture, the next step the pre-norm hidden", reviewed=("v0.21.0",))
VL_36545 = vl("v0.18.0", "LlamaModel.__init__", 'self.norm_before_fc = getattr(self.config, "norm_before_fc", False) '
              '... if not self.model.norm_before_fc: skip_substrs.append("input_norm.")',
              "PR #36545 (Add norm_before_fc for gpt-oss draft models): first in 0.18.0, absent from 0.17.1; the "
              "top-level key only until 0.22.0; input_norm.* skipped without an error while it is off")
VL_42764 = vl("v0.22.0", "LlamaModel.__init__", 'self.norm_before_fc = bool( eagle_config.get( "norm_before_fc", '
              'getattr(self.config, "norm_before_fc", False) ) ) ... use_fc_norm = getattr(self.config, "fc_norm", '
              'False) ... self.norm_output = getattr(self.config, "norm_output", False)',
              "first in 0.22.0, absent from 0.21.0: fc_norm and norm_output as PR #42764 (Support post-norm "
              "architecture for EAGLE-3 speculators) adds them, eagle_config.norm_before_fc read first as PR "
              "#42143 does", reviewed=("v0.34.0",))
VL_AUX = vl("v0.12.0", "Eagle3LlamaForCausalLM.load_weights", 'if not self.model.use_aux_hidden_state: '
            'skip_substrs.append("fc.")',
            "eagle_config.use_aux_hidden_state false: no fc is built and fc.* is skipped without an error; first in "
            "0.12.0, absent from 0.11.2 (where fc is always built and read)", reviewed=("v0.34.0",))
VL_THREE = vl("v0.21.0", "LlamaModel.__init__", 'if hasattr(self.config, "target_hidden_size"): fc_input_size = '
              "self.config.target_hidden_size * 3 else: fc_input_size = self.config.hidden_size * 3",
              "fc is built for three aux states whatever the config says (0.11.0: torch.nn.Linear("
              "self.config.target_hidden_size * 3, ...)): a draft whose fc.weight takes another count fails "
              "ReplicatedLinear's weight loader and the server does not start", reviewed=("v0.11.0",))
VL_AUX_COUNT = vl("v0.22.0", "LlamaModel.__init__", 'self.num_aux_hidden_states = getattr( self.config, '
                  '"num_aux_hidden_states", None ) if self.num_aux_hidden_states is None: ... self.num_aux_hidden_states '
                  "= len(layer_ids) if layer_ids else 3 ... self.fc_input_size = target_hidden_size * "
                  "self.num_aux_hidden_states",
                  "first in 0.22.0, absent from 0.21.0: fc takes target_hidden_size x num_aux_hidden_states (else the "
                  "number of eagle_config's layer ids, else 3)")
VL_EMBED_0 = vl("v0.11.0", "EagleProposer.load_model", "if eagle_shape == target_shape: logger.info( \"Assuming the "
                "EAGLE head shares the same vocab embedding\" ...) del self.model.model.embed_tokens "
                "self.model.model.embed_tokens = target_embed_tokens",
                "with one pipeline stage the target's embedding replaces the draft's whenever the shapes match",
                path="vllm/v1/spec_decode/eagle.py")
VL_28549 = vl("v0.11.1", "EagleProposer.load_model", 'if not self.model.has_own_embed_tokens: share_embeddings = True '
              "... elif ... torch.equal( target_embed_tokens.weight.cpu(), self.model.model.embed_tokens.weight.cpu()"
              ' ... else: logger.info( "Detected EAGLE model with distinct embed_tokens weights. "',
              "PR #28549 (Add support for Eagle with separate lm-head and embed_tokens layers): first in 0.11.1, "
              "absent from 0.11.0; a draft's own embed_tokens that is not torch.equal to the target's is kept; "
              "0.34.0: vllm/v1/worker/gpu/spec_decode/eagle/utils.py _should_share, the same rule; under TP the "
              "comparison is made per rank (vllm-project/vllm issue #50158, open)",
              path="vllm/v1/spec_decode/eagle.py", reviewed=("v0.18.0", "v0.34.0"))

VLLM = LoaderLine(
    "vllm", VL_FILE, "0.11.0", "0.34.0", Cited(READS, VL_REFUSES),
    Loader(unknown=Cited(Fate.REFUSED, VL_REFUSES), **_no_norm_keys(VL_NO_NORMS),
           norm_before_residual=Cited(Use.HONOURED, VL_RESIDUAL), idle_input_norm=Cited(Fate.REFUSED, VL_REFUSES),
           aux_off_fc=Cited(Fate.READ, VL_AUX), embed=Cited(EmbedUse.TARGETS_IF_SAME_SHAPE, VL_EMBED_0),
           aux_count=Cited(AuxCount.THREE, VL_THREE)),
    (Change(("#28549",), "a draft's own distinct embed_tokens kept", None, "0.11.1",
            {"embed": Cited(EmbedUse.OWN_IF_DISTINCT, VL_28549)}),
     Change((), "fc skipped when use_aux_hidden_state is false", None, "0.12.0",
            {"aux_off_fc": Cited(Fate.SKIPPED, VL_AUX)}),
     Change(("#36545",), "norm_before_fc honoured (top-level key)", None, "0.18.0",
            {"norm_before_fc": Cited(Use.HONOURED, VL_36545), "idle_input_norm": Cited(Fate.SKIPPED, VL_36545),
             "nested_norm_before_fc": Cited(False, VL_36545)}),
     Change(("#42764", "#42143"), "fc_norm, norm_output; eagle_config.norm_before_fc", None, "0.22.0",
            {"fc_norm": Cited(Use.HONOURED, VL_42764), "norm_output": Cited(Use.HONOURED, VL_42764),
             "nested_norm_before_fc": Cited(True, VL_42764)}),
     Change((), "fc sized from num_aux_hidden_states", None, "0.22.0",
            {"aux_count": Cited(AuxCount.FROM_CONFIG, VL_AUX_COUNT)})))

LINES = {"sglang": SGLANG, "vllm": VLLM}


def lookup(text: str) -> ServedLoader:
    """`ENGINE[@VERSION][:MODEL]` -> the draft loader of that version (`:MODEL` is accepted and has no effect: one
    draft model file serves every target)."""
    spec, plus, _ = text.partition("+")
    asked, at, version = spec.partition(":")[0].partition("@")
    if at and not version:  # as a profile name: `sglang@` is refused rather than read as latest
        raise UsageError(f"--server {text!r} has an @ and no version; give a release, a date "
                         f"or latest (e.g. {asked}@latest), or drop the @")
    engine = registry.ALIASES.get(asked, asked)
    if engine == registry.CPU_BUILD:  # vLLM's CPU build loads the draft with vLLM's own loader
        engine, version = "vllm", version or registry.CPU_PUBLISHED
    if plus:
        raise UsageError(f"--server {text}: no patch applies to a draft loader; drop +{text.partition('+')[2]}")
    if engine in registry.TRAINERS:
        raise UsageError(f"--server {text}: {engine} trains drafts, it serves none; name a serving engine "
                         f"({', '.join(LINES)})")
    if engine not in LINES:
        raise UsageError(f"unknown --server {text!r}: tpsim knows the EAGLE-3 draft loaders of {', '.join(LINES)}, "
                         "e.g. --server sglang@0.5.12,vllm")
    line, releases = LINES[engine], registry.RELEASES[engine]
    when = registry.when(engine, version or "latest")
    if when.release is not None and when.release > registry.version_key(line.newest):
        raise UsageError(f"--server {text}: {version} is newer than {line.newest}, the newest {engine} release whose "
                         "draft loader tpsim read; give one up to it, a date, or 'latest'")
    name = f"{registry.CPU_BUILD if asked == registry.CPU_BUILD else engine}@{version or 'latest'}"
    if not when.has(Change((), "", None, line.oldest, {}), releases):
        return ServedLoader(name, line, None)
    behaviour = line.base
    for change in line.changes:
        if when.has(change, releases):
            behaviour = replace(behaviour, **change.changes)
    return ServedLoader(name, line, behaviour)
