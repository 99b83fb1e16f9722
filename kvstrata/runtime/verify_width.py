"""How many positions a speculative decode step verifies per sequence: the *verify width*.

The DFlash drafter proposes ``B - 1`` tokens per sequence in one forward; the target then
verifies the pending token and the first ``V - 1`` drafts (``V <= B``) in one forward of
``b * V`` rows. Greedy acceptance keeps every output token the target's own for any ``V``;
``V`` only moves how many tokens a step produces and what it costs:

- at batch 1 a step reads every weight once whatever ``V`` is (memory-bound), so ``V = B``
  costs almost nothing over ``V = 4``;
- at batch 16-64 the verify products are compute-bound (1024 rows at batch 64): their time
  grows with ``b * V``, while a sequence gains ever less from drafts deep in the block, each
  accepted only if every earlier one was;
- ``V = 1`` drafts nothing: the step verifies the pending token alone, a plain decode step
  that still writes the drafter's context (so a later step can draft again). It is the best
  width when the drafts are accepted too seldom to pay for drafting them.

:class:`WidthPolicy` picks, per captured batch size ``b``, the width with the most expected
tokens per unit of device time::

    E(V) = sum_{k=0}^{V-1} prod_{j=1}^{k} p_j     (the bonus token, then accepted drafts)
    V*   = argmax_V E(V) / T(b, V)

``p_j`` is the probability that draft ``j`` is accepted when drafts ``1 .. j-1`` were,
counted from the steps' results. The runner drafts a block of ``V`` positions at width ``V``
(``RunnerConfig.draft_block``), so the drafts at two widths are not the same tokens; one set of
counts for every width assumes a draft's acceptance depends little on the block behind it
(greedy AL of the shipped pair, a block of V against the 16-block's first V - 1 drafts: within
3% at V = 2, 4, 8; docs/benchmarks.md, eleventh runner session). A position a step did not
verify is not a trial (the counts are censored at each step's width; a step at width 1 tries
none). Each position's estimate is shrunk toward the rate pooled
over every position, ``(a_j + q) / (t_j + 1)`` with ``q = (sum a + 1) / (sum t + 1)``, so a
position no step has reached yet takes the pooled rate, and a new engine (no counts: ``q =
1``) starts at the full width and narrows on evidence.

``T(b, V)`` is the device time of the step's graphs measured at capture (every row padding:
the products, the LM heads, no context) plus two learned terms, both from measured step times
(CUDA events around the step, read when it is collected):

- ``extra(b)``: what the steps at the chosen width took beyond their capture time, a running
  mean over every such step. It follows the contexts as they grow (attention over the real
  contexts).
- ``offset(b, V)``: what a step at width ``V`` took beyond ``capture + extra(b)``, learned from
  the steps that ran at a width other than the chosen one. Wider widths attend more query
  rows, so at long contexts their excess is larger than the chosen width's: one excess for
  every width had put the full width 12% low at 16 x 8k (docs/benchmarks.md, ninth runner
  session).

Now and then a step runs at a width not chosen (*exploration*): the offsets stay current, and
the steps at the full width keep the deep positions' counts following the workload. Each width
not chosen runs once every ``cost / explore_cost`` steps of its batch size (at least
``explore_every``, at most 32 times that), where ``cost = T(V) / T(V*) - E(V) / E(V*)`` is
what one such step gives up, in steps of the chosen width's throughput: exploring then costs
about ``explore_cost`` of the throughput per width. (Until the twelfth runner session the cost
was ``1 - rate(V) / rate(V*)``, which leaves out that a wide step also takes longer. With five
widths and the step times measured at 64 x 1k, ``benchmarks/width_policy_sim.py`` loses
1.5-2.7% to exploration under that rule and 1.0-1.4% under this one, for drafts accepted with
probability 0 to 0.8; docs/benchmarks.md, twelfth runner session.)
"""

from __future__ import annotations

import numpy as np

#: ``KVSTRATA_VERIFY_WIDTHS``: the verify widths the runner captures, comma-separated (e.g.
#: ``16`` pins the full block); overrides :attr:`~.config.RunnerConfig.verify_widths`.
WIDTHS_ENV = "KVSTRATA_VERIFY_WIDTHS"


def default_widths(block: int) -> tuple[int, ...]:
    """The full block, half and a quarter of it, 2 and 1, widest first.

    Width 2 (one draft per step) is where a drafter that is seldom accepted does best at
    batch 16-64: the 8B-shaped pair's speculative step at 64 x 1k takes 9.93 ms at width 2
    against 12.64 at 4. Width 1 drafts nothing: the step verifies the pending token alone
    (a plain decode step that also writes the drafter's context, so the drafter can take
    over again), for a drafter accepted so seldom that drafting does not pay (at 64 x 1k,
    below about a third of its drafts). Each width not chosen costs ~0.25% of throughput in
    exploration steps (``explore_cost``) and one more graph per batch size
    (docs/benchmarks.md, twelfth runner session)."""
    keep = {w for w in (block, block // 2, block // 4, 2, 1) if 1 <= w <= block}
    return tuple(sorted(keep | {block}, reverse=True))


def parse_widths(value, block: int, source: str) -> tuple[int, ...]:
    """Validated widths, widest first: integers in ``[1, block]`` (1: no drafts, see
    :func:`default_widths`). ``value``: an iterable of ints or a comma-separated string."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        try:
            ws = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"{source}={value!r}: comma-separated integers, e.g. "
                             f"'{block}' or '{','.join(map(str, default_widths(block)))}'"
                             ) from None
    else:
        ws = list(value)
        if any(not isinstance(w, int) or isinstance(w, bool) for w in ws):
            raise ValueError(f"{source} must be integers, got {value!r}")
    if not ws or any(not 1 <= w <= block for w in ws):
        raise ValueError(f"{source}={value!r}: verify widths are 1..{block} positions (the "
                         f"draft block is {block})")
    return tuple(sorted(set(ws), reverse=True))


class WidthPolicy:
    """Chooses each decode step's verify width (see the module docstring).

    Args:
        block: the draft block size ``B``.
        widths: the captured widths, widest first.
        explore_every: the shortest period, in steps of a batch size, of running a width
            not chosen (see the module docstring); the longest is 32 times it.
        explore_cost: the share of throughput each width not chosen may cost by being
            explored.
        halve_at: the acceptance counts are halved when the first position's trials reach
            this, so they follow the recent workload.
        decide_every: a batch size's best width is recomputed every this many of its steps
            (the choice costs a dictionary lookup on the others).
    """

    def __init__(self, block: int, widths: tuple[int, ...], explore_every: int = 32,
                 halve_at: int = 1 << 15, decide_every: int = 16, explore_cost: float = 0.0025):
        self.block, self.widths = block, tuple(widths)
        self.explore_every, self.explore_cost = explore_every, explore_cost
        self.halve_at, self.decide_every = halve_at, decide_every
        # rows whose last tried / last accepted draft was j (index j; 0: none)
        self._last_tried = np.zeros(block, dtype=np.float64)
        self._last_accepted = np.zeros(block, dtype=np.float64)
        self.capture_ms: dict[tuple[int, int], float] = {}
        #: running mean of measured - capture time at the chosen width, by batch size
        self.extra_ms: dict[int, float] = {}
        #: running mean of measured - capture - extra at a width not chosen, by (size, width)
        self.offset_ms: dict[tuple[int, int], float] = {}
        self._steps: dict[int, int] = {}
        self.chosen: dict[int, int] = {}
        self._due: dict[tuple[int, int], int] = {}     # (size, width) -> its next exploration

    @property
    def adaptive(self) -> bool:
        return len(self.widths) > 1

    # -- evidence ------------------------------------------------------------------------------
    def observe(self, produced: np.ndarray, verified: np.ndarray) -> None:
        """One step's rows: ``produced`` tokens (accepted drafts + 1) and ``verified``
        positions (``min(V, block length)``; 0 for a padding row)."""
        if produced.size == 0 or self.block < 2:
            return
        # A row verified drafts 1 .. v-1 and produced L <= v tokens: it tried drafts 1 ..
        # min(L, v-1) and accepted drafts 1 .. L-1 (L <= v). Histograms of those last ones;
        # the counts per draft are their reversed cumulative sums (``trials``, ``accepts``).
        B = self.block
        last = np.minimum(produced, verified - 1)
        np.maximum(last, 0, out=last)
        self._last_tried += np.bincount(last, minlength=B)
        self._last_accepted += np.bincount(np.minimum(produced - 1, last), minlength=B)
        if self._last_tried[1:].sum() >= self.halve_at:
            self._last_tried *= 0.5
            self._last_accepted *= 0.5

    @property
    def trials(self) -> np.ndarray:
        """Rows that verified draft ``j`` with drafts ``1 .. j-1`` accepted (index ``j``)."""
        return _at_least(self._last_tried)

    @property
    def accepts(self) -> np.ndarray:
        """Of those, rows that accepted draft ``j`` (index ``j``)."""
        return _at_least(self._last_accepted)

    def observe_time(self, b: int, width: int, ms: float) -> None:
        """A step's measured device time at batch ``b`` and ``width``. At the chosen width it
        moves ``extra(b)`` (that width's own offset taken out); at another width, the width's
        ``offset(b, V)`` (see the module docstring)."""
        base = self.capture_ms.get((b, width))
        if base is None or not np.isfinite(ms):
            return
        d = ms - base
        off = self.offset_ms.get((b, width), 0.0)
        prev = self.extra_ms.get(b)
        if prev is None or width == self.chosen.get(b, width):
            self.extra_ms[b] = d - off if prev is None else 0.9 * prev + 0.1 * (d - off)
            return
        r = d - prev
        self.offset_ms[(b, width)] = r if (b, width) not in self.offset_ms else 0.7 * off + 0.3 * r

    # -- model ----------------------------------------------------------------------------------
    def acceptance(self) -> np.ndarray:
        """``p_j`` for drafts ``j = 1 .. B-1``, shrunk toward the pooled rate (an untried
        position takes it; with no counts at all it is 1)."""
        a, t = self.accepts[1:], self.trials[1:]
        q = (a.sum() + 1.0) / (t.sum() + 1.0)
        return (a + q) / (t + 1.0)

    def expected_tokens(self, width: int, p: np.ndarray | None = None) -> float:
        """``E(V)``: tokens a sequence's step produces on average at this width (``p``: the
        acceptance to use, default :meth:`acceptance`)."""
        p = (self.acceptance() if p is None else p)[:width - 1]
        return float(1.0 + np.cumprod(p).sum())

    def step_ms(self, b: int, width: int) -> float | None:
        base = self.capture_ms.get((b, width))
        if base is None:
            return None
        return max(base + self.extra_ms.get(b, 0.0) + self.offset_ms.get((b, width), 0.0), 1e-6)

    def rate(self, b: int, width: int, p: np.ndarray) -> float | None:
        """Expected tokens per millisecond of a step at batch ``b`` and ``width`` (``None``
        without a measured time)."""
        t = self.step_ms(b, width)
        return None if t is None else self.expected_tokens(width, p) / t

    def best(self, b: int) -> int:
        """The width with the most expected tokens per millisecond at batch ``b`` (the widest
        while any width of ``b`` has no measured time)."""
        if not self.adaptive:
            return self.widths[0]
        p = self.acceptance()
        rates = [self.rate(b, w, p) for w in self.widths]
        if any(r is None for r in rates):
            return self.widths[0]
        return self.widths[int(np.argmax(rates))]

    def choose(self, b: int) -> int:
        """The width of the next step at batch ``b``: :meth:`best`, recomputed every
        ``decide_every`` steps of ``b``, unless a width not chosen is due to be explored
        (widest first)."""
        if not self.adaptive:          # one width: nothing to decide or explore
            w = self.chosen[b] = self.widths[0]
            return w
        n = self._steps[b] = self._steps.get(b, 0) + 1
        w = self.chosen.get(b)
        if w is None or n % self.decide_every == 0:
            w = self.chosen[b] = self.best(b)
        for x in self.widths:
            if x == w:
                continue
            due = self._due.setdefault((b, x), self.explore_every)
            if n >= due:
                self._due[(b, x)] = n + self.explore_period(b, x, w)
                return x
        return w

    def explore_period(self, b: int, width: int, chosen: int) -> int:
        """Steps of batch ``b`` between two explorations of ``width`` while ``chosen`` is the
        best (see the module docstring)."""
        lo = self.explore_every
        t, tc = self.step_ms(b, width), self.step_ms(b, chosen)
        if t is None or tc is None:
            return lo
        p = self.acceptance()
        cost = t / tc - self.expected_tokens(width, p) / self.expected_tokens(chosen, p)
        return int(min(max(cost / self.explore_cost, lo), 32 * lo))

    def stats(self) -> dict:
        """The captured widths, the width last chosen per batch size, the drafts' estimated
        acceptance by position and, per batch size with measured times, the estimated step
        time ``T(b, V)`` of every width (milliseconds): the inputs of each choice."""
        est = {int(b): {int(w): round(float(self.step_ms(b, w)), 3) for w in self.widths}
               for b in sorted(self.chosen)
               if all(self.step_ms(b, w) is not None for w in self.widths)}
        return {"verify_widths": list(self.widths),
                "verify_width_by_batch": {int(b): int(w) for b, w in sorted(self.chosen.items())},
                "draft_acceptance": [round(float(p), 4) for p in self.acceptance()],
                "verify_step_ms": est}


def _at_least(last: np.ndarray) -> np.ndarray:
    """From a histogram of rows' last draft ``j``, the rows that reached each ``j >= 1``
    (reversed cumulative sum; index 0 is 0)."""
    c = np.cumsum(last[::-1])[::-1].copy()
    c[0] = 0.0
    return c


__all__ = ["WIDTHS_ENV", "WidthPolicy", "default_widths", "parse_widths"]
