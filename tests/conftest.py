"""Hypothesis profiles and the session-wide pool of real gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from tpsim.base.errors import RankError
from tpsim.parallel.pool import RankPool

torch.set_num_threads(1)  # the in-process TP=1 reference runs the same kernels as a rank

# `ci` keeps Hypothesis' built-in CI settings (derandomize, no database, print_blob).
settings.register_profile("ci", settings.get_profile("ci"), max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

WORLD = 8


class Pool:
    """A RankPool that restarts itself after a rank failure, so Hypothesis can keep shrinking."""

    def __init__(self, world: int):
        self.world = world
        self.pool = None

    def run(self, fn: str, **kwargs) -> dict:
        if self.pool is None or self.pool.closed:
            self.pool = RankPool(self.world, timeout_s=60, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
        try:
            return self.pool.run(fn, **kwargs)
        except RankError:
            self.pool = None
            raise

    def close(self):
        if self.pool is not None:
            self.pool.close()


@pytest.fixture(scope="session")
def rank_pool():
    pool = Pool(WORLD)
    yield pool
    pool.close()


def pytest_report_header(config):
    return f"hypothesis profile: {settings._current_profile}, torch {torch.__version__}"
