"""Hypothesis profiles for the fuzz harness (README.md here says how to run it for hours).

    ci    (default) a short budget on every push: the whole of tests/fuzz well under 2 minutes
    long  as many inputs as time allows: --hypothesis-profile=long, stopped with Ctrl-C or `timeout`
    dev   in between, for trying a change: --hypothesis-profile=dev
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

_common = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.function_scoped_fixture]}
settings.register_profile("ci", max_examples=1000, **_common)
settings.register_profile("dev", max_examples=20_000, **_common)
# long: VRAMD_FUZZ_EXAMPLES per test (default: unbounded in practice; stop it with `timeout`)
settings.register_profile("long", max_examples=int(os.environ.get("VRAMD_FUZZ_EXAMPLES", 100_000_000)),
                          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
                          **_common)
settings.load_profile(os.environ.get("VRAMD_FUZZ_PROFILE", "ci"))



def pytest_collection_modifyitems(items):
    for item in items:
        if "/fuzz/" in str(item.fspath):
            item.add_marker(pytest.mark.fuzz)
