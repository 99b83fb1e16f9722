"""The benchmarks' shared timer: median milliseconds of a callable after one warm-up call.

On a CUDA device each run is bracketed by CUDA events on the current stream (device time, no host
synchronisation inside the measurement); ``flush``, when given, is a buffer larger than the L2 that
is zeroed before every run so each run starts with a cold L2 (FlashInfer's practice). Elsewhere the
runs are timed with ``time.perf_counter``.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


#: GPU cycles of the sleep queued before a timed run with ``device_only`` (~1 ms on an H200):
#: longer than the host needs to launch what ``fn`` queues.
SLEEP_CYCLES = 2_000_000


def median_ms(fn: Callable[[], object], device: torch.device, reps: int,
              flush: torch.Tensor | None = None, sync_all: bool = False,
              setup: Callable[[], object] | None = None, device_only: bool = False) -> float:
    """Median time (ms) of ``reps`` calls of ``fn()``, after one warm-up call (and compile).

    ``sync_all`` waits for every stream of the device before each run (for code that works on
    side streams, such as the tiers' copy streams, so one run never overlaps the next);
    ``setup`` runs before each call (warm-up included), outside the timed region.
    ``device_only`` (CUDA): queue a GPU-side sleep before the start event, so the device is busy
    while the host launches ``fn``'s kernels and the events time the kernels alone. Without it
    an idle device waits for the host between the events, and the time includes the launch
    work (Python, argument checks: 50-170 us per NVFP4 call on the H200 machines)."""
    if setup is not None:
        setup()
    fn()
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        if device.type == "cuda":
            if sync_all:
                torch.cuda.synchronize(device)
            if flush is not None:
                flush.zero_()
            if device_only:
                torch.cuda._sleep(SLEEP_CYCLES)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)
