"""Test-wide settings: Triton runs through its interpreter on the CPU; hypothesis profiles.

KVSTRATA_HYPOTHESIS_PROFILE selects ``ci`` (derandomized, bounded; the default) or ``nightly``
(many more examples, no deadline). KVSTRATA_SLOW=1 runs tests marked ``slow``.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", derandomize=True, max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("nightly", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("dev", max_examples=20, deadline=None)
settings.load_profile(os.environ.get("KVSTRATA_HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KVSTRATA_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set KVSTRATA_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
