"""A real engine beside the replays: runner.py runs an installed vLLM in its own interpreter (vllm_main.py, with
vllm_hooks.py for its workers; neither imports tpsim) and returns what it observed."""
