"""The trained SmolLM2 draft (configs/drafts/smollm2-135m-eagle3) with its config or tensors changed: the engine
matrix's drafts (tests/test_engine.py) and the tests that measure the same drafts without the engine."""

from __future__ import annotations

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "configs" / "drafts" / "smollm2-135m-eagle3"
ONE_STATE = ROOT / "configs" / "drafts" / "smollm2-135m-eagle3-one-state"  # trained on out(14) alone


def shipped(change=None, tensors=None, source=SHIPPED):
    """A trained SmolLM2 draft (the shipped one unless `source`) with its config changed (`change(config)`) or
    tensors added."""
    def make(folder: Path) -> Path:
        folder.mkdir(parents=True)
        config = json.loads((source / "config.json").read_text())
        (change or (lambda c: None))(config)
        (folder / "config.json").write_text(json.dumps(config))
        if tensors is None:
            os.symlink(source / "model.safetensors", folder / "model.safetensors")
        else:
            from safetensors.torch import load_file, save_file
            t = load_file(str(source / "model.safetensors"))
            save_file({**t, **tensors(t)}, str(folder / "model.safetensors"))
        return folder
    return make


def one_state(c):
    """One aux state, out(13) where vLLM reads its ids: fc 576 -> 576, as wide as the draft's embedding."""
    c["eagle_aux_hidden_state_layer_ids"] = [14]
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [14]


def one_state_fc(t):
    """The shipped fc's block for out(14) alone (times 3: the share the other two blocks carried)."""
    return {"fc.weight": (t["fc.weight"][:, 576:1152].float() * 3).half().contiguous()}
