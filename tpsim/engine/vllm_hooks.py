"""What vLLM's workers run on their target model (`LLM.apply_model`). Runs in the engine's interpreter, where
tpsim is not installed: this module imports nothing of tpsim, and the workers import it by name (its folder is
on their PYTHONPATH), which is how vLLM sends a function to them."""


def capture_ids(model):
    """The ids the model's capture loop holds (EagleModelMixin and DeepseekV2Model keep them as
    `aux_hidden_state_layers`), or None when the model keeps none."""
    inner = getattr(model, "model", model)
    ids = getattr(inner, "aux_hidden_state_layers", None)
    return None if ids is None else [int(i) for i in ids]


def hook(model, ids=None):
    """Wrap the target's forward so the first forward after each `take` (a request's prefill) keeps its aux
    states: under EAGLE-3 the forward returns `(hidden, aux)`, aux a list of [T, H] tensors. `ids` (a launch
    without a draft): set them on the target's own capture loop, and hand its runner the hidden states alone."""
    store = []
    orig = model.forward
    if ids is not None:
        model.set_aux_hidden_state_layers(tuple(ids))

    def forward(*args, **kwargs):
        out = orig(*args, **kwargs)
        if not store and isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (list, tuple)):
            store.append([t.detach().float().cpu().clone() for t in out[1]])
        return out[0] if ids is not None and isinstance(out, tuple) else out

    model.forward = forward
    model._tpsim_store = store
    return True


def take(model):
    """This rank's kept prefill aux states (a list of [T, H] float32 tensors; [] when none was returned)."""
    store = getattr(model, "_tpsim_store", [])
    out = store[0] if store else []
    store.clear()
    return [t.numpy() for t in out]
