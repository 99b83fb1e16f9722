"""``ServerMetrics``: the series read from an ``LLM.stats()`` snapshot at scrape time (no server:
the CUDA-only runner fields are given in the snapshot)."""

from __future__ import annotations

from serverproc import parse_metrics
from kvstrata.serve.metrics import ServerMetrics


def test_runner_width_series_from_a_snapshot():
    snap = {"runner": {"verify_widths": [16, 8, 4], "verify_width_by_batch": {1: 16, 64: 4},
                       "draft_acceptance": [0.85, 0.8],
                       "verify_step_ms": {64: {16: 34.1, 8: 21.7, 4: 14.9}}}}
    m = parse_metrics(ServerMetrics("m", 16).render(snap))
    assert m['kvstrata_verify_width{batch="1"}'] == 16
    assert m['kvstrata_verify_width{batch="64"}'] == 4
    assert m['kvstrata_draft_acceptance{position="2"}'] == 0.8
    assert {k: v for k, v in m.items() if k.startswith("kvstrata_verify_step_ms")} == {
        'kvstrata_verify_step_ms{batch="64",width="16"}': 34.1,
        'kvstrata_verify_step_ms{batch="64",width="8"}': 21.7,
        'kvstrata_verify_step_ms{batch="64",width="4"}': 14.9}
    # a runner without measured widths (graphs off): no width series at all
    m = parse_metrics(ServerMetrics("m", 16).render({"runner": {"verify_widths": [16],
                                                           "verify_width_by_batch": {},
                                                           "verify_step_ms": {}}}))
    assert not any(k.startswith(("kvstrata_verify_width", "kvstrata_verify_step_ms")) for k in m)
