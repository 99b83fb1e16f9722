"""Overlapped decode steps: the engine core submits step N + 1 before it reads step N's tokens.

With overlapping on (``RunnerConfig.overlap``, the default on CUDA), while every running
request decodes greedily on the decode path and no waiting request can be admitted, the core
submits step N + 1 before it reads step N's tokens (``ModelRunner.submit_next`` continues each
sequence from step N's output on the device; pages are reserved two blocks ahead), then does
step N's host work (acceptance, stops, commit: :mod:`.core`'s step 5) while the device computes
step N + 1. A request that finishes in step N still has a row in step N + 1: that row is
dropped, and its pages are freed only once step N + 1 is collected (``_release`` defers them).
Anything else (admission, prefill, preemption, sampling, ``close``, or a step of another
scheduler: ``prefill``/``resume`` run their own, and overlap their decode steps the same way)
first lands the step in flight.

:class:`OverlappedSteps` is the part of :class:`~.core.EngineCore` that holds the step in
flight; the core builds on it (``runner``, ``mgr``, ``block_size``, ``_counters`` and the
request methods ``_fits``, ``_item``, ``_accept``, ``_release``, ``_fail``, ``_abort`` are the
core's).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from ..pagepool.pool import OutOfPagesError
from .runner import InFlight
from .scheduler import DECODE, DONE, Request, Scheduler, StepPlan

log = logging.getLogger("kvstrata.runtime")

#: What ``_accept`` reads of a continued decode row's step item.
_DECODE_ROW = SimpleNamespace(decode=True)


@dataclass(slots=True, eq=False)
class _Flight:
    """A decode step on the device whose tokens the host has not read yet."""

    handle: InFlight
    rows: list[Request]                 # the step's rows, in order
    sched: Scheduler
    ids: set = field(default_factory=set)        # id() of each row's request
    defer: list[Request] = field(default_factory=list)   # finished meanwhile: free after it


class OverlappedSteps:
    """The step in flight (``_flight``): submit it, continue it on the device, land it, or
    abandon it and free what it held."""

    _flight: _Flight | None        # set by the core's __init__

    def _submit(self, sched: Scheduler, plan: StepPlan) -> bool:
        """Submit ``plan`` as the step in flight when it is a decode-path step and overlapping
        is on (``False``: run it the synchronous way)."""
        if not self.runner.overlap or plan.prefill:
            return False
        items = [self._item(r, n, True) for r, n in plan.decode]
        if not self.runner.decode_ok(items):
            return False
        handle = self.runner.submit(items)
        rows = [r for r, _ in plan.decode]
        self._flight = _Flight(handle, rows, sched, {id(r) for r in rows})
        return True

    def _continuable(self, sched: Scheduler, f: _Flight) -> bool:
        """Whether the next step can be submitted from ``f``'s output on the device: the same
        requests all still decode greedily on the decode path (no ``min_tokens`` masking), no
        waiting request could be admitted now, and every row's pages for two more blocks are
        free now (no preemption while a step is in flight)."""
        if not self.runner.overlap:
            return False
        if sched.waiting and sched.free_seats() > 0 and (
                sched.waiting[0].state == DECODE or self._fits(sched, sched.waiting[0])):
            return False        # the next request can be admitted now: land first
        live = [r for r in f.rows if r.state == DECODE]
        B = self.block_size
        if not live or len(live) != len(sched.running) or len(live) > sched.budget // B:
            return False
        for r in live:
            if not r.params.greedy or (r.stop_ids and r.params.min_tokens > r.num_generated):
                return False
        try:
            for r in live:
                self.mgr.reserve(r.seq_id, min(r.max_length, r.num_computed + 2 * B))
        except OutOfPagesError:
            return False
        return True

    def _land(self, sched: Scheduler, chain: bool) -> list[Request]:
        """Collect the step in flight and do its host work (acceptance, commit, retirement);
        with ``chain``, first submit the step that continues it when possible. Returns the
        requests whose tokens landed."""
        t0 = time.perf_counter()
        f = self._flight
        nxt = None
        try:
            if chain and self._continuable(sched, f):
                keep = [(i, r) for i, r in enumerate(f.rows) if r.state == DECODE]
                rows = [r for _, r in keep]
                handle = self.runner.submit_next(f.handle, [i for i, _ in keep],
                                                 [r.seq_id for r in rows],
                                                 [r.max_length for r in rows])
                nxt = _Flight(handle, rows, sched, {id(r) for r in rows})
            produced = self.runner.collect(f.handle)
        except Exception as e:
            log.warning("decode step failed in flight: %s: %s", type(e).__name__, e)
            self._abandon(sched, e, nxt)
            return list(f.rows)
        except BaseException as e:
            self._abandon(sched, e, nxt)
            raise
        self._flight = nxt
        landed = [(r, new) for r, new in zip(f.rows, produced) if r.state == DECODE]
        B = self.block_size
        scheduled = [(r, r.block_len(B)) for r, _ in landed]
        for r, _ in landed:
            r.last_al = None
        try:
            self._accept(scheduled, [_DECODE_ROW] * len(landed), [new for _, new in landed])
        except BaseException as e:
            self._flight = f
            self._abandon(sched, e, nxt)
            if not isinstance(e, Exception):
                raise
            return [r for r, _ in landed]
        c = self._counters
        c["steps"] += 1
        c["draft_s"] = self.runner.timing.draft_s
        c["target_s"] = self.runner.timing.target_s
        for r in f.defer:
            self._release(r)
        for r in sched.retire():
            self._release(r)        # deferred while the next step holds its row
            sched.finished.append(r)
        self._settle()              # every row of the next step may have finished
        c["step_s"] += time.perf_counter() - t0
        return [r for r, _ in landed]

    def _drain(self) -> list[Request]:
        """Land the step in flight, submitting nothing after it (before a step of another
        scheduler). Returns the requests whose tokens landed."""
        f = self._flight
        return self._land(f.sched, chain=False) if f is not None else []

    def _abandon(self, sched: Scheduler, error: BaseException | None = None,
                 nxt: _Flight | None = None) -> None:
        """Wait for the step in flight (and ``nxt``, one submitted after it) without using their
        tokens, then free what they held. With ``error`` (the host or the device failed
        mid-flight), their unfinished requests fail with it (or are aborted, for
        ``KeyboardInterrupt`` and the like)."""
        flights = [x for x in (self._flight, nxt) if x is not None]
        self._flight = None
        for f in flights:
            try:
                self.runner.drop(f.handle)
            except Exception:   # noqa: BLE001 - the device failed: its pages are freed anyway
                pass
        for f in flights:
            for r in f.rows:
                if error is not None and r.state != DONE:
                    if isinstance(error, Exception):
                        self._fail(sched, r, error)
                    else:
                        self._abort(sched, r)
            for r in f.defer + [r for r in f.rows if r.state == DONE]:
                self._release(r)

    def _settle(self) -> None:
        """A step in flight whose every row finished (or was aborted) is waited for and its
        pages freed: nothing else would land it."""
        f = self._flight
        if f is not None and all(r.state == DONE for r in f.rows):
            self._abandon(f.sched)


__all__ = ["OverlappedSteps"]
