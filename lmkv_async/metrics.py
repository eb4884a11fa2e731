"""Per-operation counters and latency histograms: :class:`OpStats`, and an OpenTelemetry bridge.

A small recorder with no dependencies, cheap enough to call on every
operation. For each operation name (``"store"``, ``"retrieve"``,
``"lookup"``, ...) it keeps:

* ``count``: finished calls, successful or not;
* ``errors``: calls that raised, with ``errors_by_type`` keyed by the
  exception's class name (``"ServerTimeoutError"``, ...);
* ``timeouts``: calls that raised a :class:`TimeoutError` (every
  :class:`~lmkv_async.ServerTimeoutError` is one);
* ``cancelled``: calls whose caller was cancelled (not counted as errors), on
  asyncio or trio;
* ``bytes``: KV bytes moved by successful calls;
* ``in_flight``: calls running now (:meth:`OpStats.in_flight`);
* ``latency``: a histogram over fixed, log-spaced buckets
  (:data:`BUCKET_BOUNDS`, 100 us to 100 s, four per decade), its sum,
  min, max and estimated quantiles.

Typical use, around one operation::

    stats = OpStats()
    with stats.measure("retrieve") as m:   # in flight while inside; timed; errors recorded
        out = await ctx.retrieve(tokens)
        m.nbytes = 0 if out is None else out.numel() * out.element_size()
    stats.snapshot()["ops"]["retrieve"]["latency"]["p99"]

or, when timing is done elsewhere, ``stats.record(op, seconds, nbytes, error)``
plus ``with stats.in_flight(op):``.

:func:`register_otel` exposes the same numbers as OpenTelemetry instruments on
a ``Meter`` the caller owns (extra ``lmkv_async[otel]``); nothing here imports
``opentelemetry`` unless that function is called.

The recorder keeps numbers only, never keys, token ids or tensor contents, so a
snapshot is safe to log or export.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

__all__ = [
    "BUCKET_BOUNDS",
    "LatencyHistogram",
    "Measurement",
    "OpStats",
    "register_otel",
]

#: Upper bounds (seconds, inclusive) of the latency buckets: 100 us to 100 s,
#: four per decade (ratio ~1.78). A last, unbounded bucket catches the rest.
BUCKET_BOUNDS: tuple[float, ...] = tuple(10.0 ** (e / 4) for e in range(-16, 9))

def _is_cancellation(error: BaseException) -> bool:
    """Whether ``error`` is a cancellation of either backend: asyncio's
    ``CancelledError`` or trio's ``Cancelled`` (looked up only once trio is loaded,
    so recording never imports it). Not ``anyio.get_cancelled_exc_class()``: that
    needs a running event loop, and :meth:`OpStats.record` may be called from a
    thread."""
    if isinstance(error, asyncio.CancelledError):
        return True
    trio = sys.modules.get("trio")
    return trio is not None and isinstance(error, trio.Cancelled)


#: Called after every record: ``listener(op, seconds, nbytes, error)``.
Listener = Callable[[str, float, int, "BaseException | None"], None]


class LatencyHistogram:
    """Counts of latencies per fixed bucket, plus count, sum, min and max.

    Not thread-safe by itself; :class:`OpStats` guards it with its lock.
    """

    __slots__ = ("bounds", "count", "counts", "max", "min", "sum")

    def __init__(self, bounds: Sequence[float] = BUCKET_BOUNDS) -> None:
        """Empty histogram over ``bounds`` (increasing upper bounds, in seconds)."""
        if not bounds or any(b <= a for a, b in itertools.pairwise(bounds)):
            raise ValueError("bounds must be a non-empty, strictly increasing sequence")
        self.bounds = tuple(float(b) for b in bounds)
        #: one count per bound, then one for values above the last bound
        self.counts = [0] * (len(self.bounds) + 1)
        self.count = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = 0.0

    def observe(self, seconds: float) -> None:
        """Add one latency (negative values count as 0)."""
        value = max(0.0, float(seconds))
        lo, hi = 0, len(self.bounds)
        while lo < hi:  # first bound >= value
            mid = (lo + hi) // 2
            if self.bounds[mid] < value:
                lo = mid + 1
            else:
                hi = mid
        self.counts[lo] += 1
        self.count += 1
        self.sum += value
        self.min = min(self.min, value)
        self.max = max(self.max, value)

    def quantile(self, q: float) -> float | None:
        """Estimated ``q``-quantile (0..1), or None when empty.

        Interpolates linearly inside the bucket that holds it, clamped to the
        observed min and max, so it is exact at the extremes and within one
        bucket (a factor ~1.78) elsewhere.
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be in [0, 1], got {q!r}")
        if self.count == 0:
            return None
        rank = q * self.count
        seen = 0
        for i, n in enumerate(self.counts):
            if n and seen + n >= rank:
                lower = self.bounds[i - 1] if i > 0 else 0.0
                upper = self.bounds[i] if i < len(self.bounds) else self.max
                lower, upper = max(lower, self.min), min(upper, self.max)
                frac = (rank - seen) / n
                return lower + (upper - lower) * frac
            seen += n
        return self.max

    def snapshot(self) -> dict[str, Any]:
        """Plain-data copy: ``buckets`` as ``[upper_bound, count]`` pairs (``inf`` last)."""
        return {
            "count": self.count,
            "sum": self.sum,
            "min": None if self.count == 0 else self.min,
            "max": None if self.count == 0 else self.max,
            "mean": None if self.count == 0 else self.sum / self.count,
            "p50": self.quantile(0.5),
            "p90": self.quantile(0.9),
            "p99": self.quantile(0.99),
            "buckets": [[b, n] for b, n in zip((*self.bounds, math.inf), self.counts,
                                                 strict=True)],
        }


class _Op:
    """Everything recorded for one operation name."""

    __slots__ = ("bytes", "cancelled", "count", "errors", "errors_by_type", "in_flight",
                 "latency", "timeouts")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.count = 0
        self.errors = 0
        self.timeouts = 0
        self.cancelled = 0
        self.bytes = 0
        self.in_flight = 0
        self.errors_by_type: dict[str, int] = {}
        self.latency = LatencyHistogram(bounds)

    def snapshot(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "errors": self.errors,
            "timeouts": self.timeouts,
            "cancelled": self.cancelled,
            "bytes": self.bytes,
            "in_flight": self.in_flight,
            "errors_by_type": dict(sorted(self.errors_by_type.items())),
            "latency": self.latency.snapshot(),
        }


class Measurement:
    """What :meth:`OpStats.measure` yields: set ``nbytes`` to the bytes the call moved."""

    __slots__ = ("nbytes", "op")

    def __init__(self, op: str) -> None:
        self.op = op
        #: KV bytes the operation moved; recorded when it succeeds
        self.nbytes = 0


class OpStats:
    """Counters, in-flight gauges and latency histograms per operation name.

    Safe to use from several threads and tasks at once. Operation names are
    free-form strings; :data:`DEFAULT_OPS` always appear in a snapshot, others
    once recorded.
    """

    #: operations present in every snapshot, even before their first call
    DEFAULT_OPS: tuple[str, ...] = ("store", "retrieve", "lookup")

    def __init__(self, bounds: Sequence[float] = BUCKET_BOUNDS) -> None:
        """An empty recorder; ``bounds`` are the latency bucket upper bounds in seconds."""
        LatencyHistogram(bounds)  # validates
        self._bounds = tuple(bounds)
        self._lock = threading.Lock()
        self._ops: dict[str, _Op] = {op: _Op(self._bounds) for op in self.DEFAULT_OPS}
        self._listeners: list[Listener] = []
        self._started = time.time()

    def __repr__(self) -> str:
        with self._lock:
            counts = ", ".join(f"{name}={op.count}" for name, op in self._ops.items())
        return f"OpStats({counts})"

    def _op(self, op: str) -> _Op:
        # caller holds the lock
        entry = self._ops.get(op)
        if entry is None:
            if not isinstance(op, str) or not op:
                raise ValueError(f"op must be a non-empty string, got {op!r}")
            entry = self._ops[op] = _Op(self._bounds)
        return entry

    def record(self, op: str, seconds: float, nbytes: int = 0,
               error: BaseException | None = None) -> None:
        """Record one finished call of ``op`` that took ``seconds``.

        ``nbytes`` counts only when ``error`` is None. A cancellation
        (:class:`asyncio.CancelledError`, or ``trio.Cancelled`` under trio) counts
        as ``cancelled``, not as an error; a :class:`TimeoutError` counts as an error and a timeout.
        Listeners (:meth:`add_listener`) are called after the lock is released.
        """
        with self._lock:
            entry = self._op(op)
            entry.count += 1
            entry.latency.observe(seconds)
            if error is None:
                entry.bytes += max(0, int(nbytes))
            elif _is_cancellation(error):
                entry.cancelled += 1
            else:
                entry.errors += 1
                name = type(error).__name__
                entry.errors_by_type[name] = entry.errors_by_type.get(name, 0) + 1
                if isinstance(error, TimeoutError):
                    entry.timeouts += 1
            listeners = list(self._listeners)
        for listener in listeners:
            listener(op, seconds, nbytes, error)

    @contextlib.contextmanager
    def in_flight(self, op: str) -> Iterator[None]:
        """Count ``op`` as in flight while the block runs (also on error or cancellation)."""
        with self._lock:
            self._op(op).in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._ops[op].in_flight -= 1

    @contextlib.contextmanager
    def measure(self, op: str) -> Iterator[Measurement]:
        """In flight, timed and recorded: :meth:`in_flight` plus :meth:`record` in one block.

        The exception that leaves the block (if any) is recorded as the error
        and re-raised unchanged.
        """
        m = Measurement(op)
        t0 = time.perf_counter()
        with self.in_flight(op):
            try:
                yield m
            except BaseException as exc:
                self.record(op, time.perf_counter() - t0, 0, exc)
                raise
        self.record(op, time.perf_counter() - t0, m.nbytes, None)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(op, seconds, nbytes, error)`` after every :meth:`record`.

        Listeners run on the recording thread and must be quick and not raise.
        """
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener`` (no error if it was not added)."""
        with self._lock, contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def ops(self) -> list[str]:
        """The operation names recorded so far (plus :data:`DEFAULT_OPS`)."""
        with self._lock:
            return list(self._ops)

    def totals(self, op: str) -> Mapping[str, int]:
        """The counters of ``op``: count, errors, timeouts, cancelled, bytes, in_flight.

        Cheaper than :meth:`snapshot` (no histogram); zeros for an unknown op.
        """
        with self._lock:
            entry = self._ops.get(op)
            if entry is None:
                return dict.fromkeys(
                    ("count", "errors", "timeouts", "cancelled", "bytes", "in_flight"), 0)
            return {"count": entry.count, "errors": entry.errors, "timeouts": entry.timeouts,
                    "cancelled": entry.cancelled, "bytes": entry.bytes,
                    "in_flight": entry.in_flight}

    def snapshot(self) -> dict[str, Any]:
        """A consistent plain-data copy (JSON-serialisable except ``inf`` bucket bounds).

        ``{"since": <unix time>, "bucket_bounds": [...], "ops": {op: {count,
        errors, timeouts, cancelled, bytes, in_flight, errors_by_type,
        latency: {count, sum, min, max, mean, p50, p90, p99, buckets}}}}``.
        """
        with self._lock:
            return {
                "since": self._started,
                "bucket_bounds": list(self._bounds),
                "ops": {name: op.snapshot() for name, op in self._ops.items()},
            }

    def reset(self) -> None:
        """Forget everything recorded; in-flight gauges keep counting calls still running."""
        with self._lock:
            running = {name: op.in_flight for name, op in self._ops.items()}
            self._ops = {op: _Op(self._bounds) for op in self.DEFAULT_OPS}
            for name, n in running.items():
                self._op(name).in_flight = n
            self._started = time.time()


def register_otel(stats: OpStats, meter: Any, *, prefix: str = "lmkv",
                  attributes: Mapping[str, str] | None = None) -> list[Any]:
    """Expose ``stats`` as OpenTelemetry instruments on ``meter`` (an ``opentelemetry`` Meter).

    Registers, each with an ``op`` attribute (plus ``attributes``, e.g. the
    server address):

    * ``{prefix}.operations`` (observable counter): finished calls;
    * ``{prefix}.errors`` (observable counter): failed calls, with ``error.type``;
    * ``{prefix}.timeouts`` and ``{prefix}.cancelled`` (observable counters);
    * ``{prefix}.bytes`` (observable counter, unit ``By``): KV bytes moved;
    * ``{prefix}.in_flight`` (observable up-down counter): calls running now;
    * ``{prefix}.duration`` (histogram, unit ``s``): fed by a listener on
      every later :meth:`OpStats.record` (OpenTelemetry has no observable
      histogram), using :data:`BUCKET_BOUNDS` as the advised bucket boundaries
      where the installed API supports that advice.

    Returns the instruments. Raises :class:`ImportError` with an install hint
    when ``opentelemetry-api`` is not installed.
    """
    try:
        from opentelemetry.metrics import CallbackOptions, Observation
    except ImportError as exc:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "register_otel needs opentelemetry-api: pip install 'lmkv_async[otel]'"
        ) from exc

    base = dict(attributes or {})

    def counter(field: str) -> Callable[[CallbackOptions], list[Observation]]:
        def callback(options: CallbackOptions) -> list[Observation]:
            return [Observation(stats.totals(op)[field], {**base, "op": op})
                    for op in stats.ops()]
        return callback

    def errors(options: CallbackOptions) -> list[Observation]:
        snap = stats.snapshot()["ops"]
        return [Observation(n, {**base, "op": op, "error.type": name})
                for op, entry in snap.items() for name, n in entry["errors_by_type"].items()]

    instruments: list[Any] = [
        meter.create_observable_counter(f"{prefix}.operations", [counter("count")],
                                        unit="{operation}",
                                        description="finished lmkv_async operations"),
        meter.create_observable_counter(f"{prefix}.errors", [errors], unit="{operation}",
                                        description="failed operations, by error type"),
        meter.create_observable_counter(f"{prefix}.timeouts", [counter("timeouts")],
                                        unit="{operation}",
                                        description="operations that timed out"),
        meter.create_observable_counter(f"{prefix}.cancelled", [counter("cancelled")],
                                        unit="{operation}",
                                        description="operations whose caller was cancelled"),
        meter.create_observable_counter(f"{prefix}.bytes", [counter("bytes")], unit="By",
                                        description="KV bytes moved by successful operations"),
        meter.create_observable_up_down_counter(f"{prefix}.in_flight", [counter("in_flight")],
                                                unit="{operation}",
                                                description="operations running now"),
    ]
    try:
        histogram = meter.create_histogram(
            f"{prefix}.duration", unit="s", description="operation latency",
            explicit_bucket_boundaries_advisory=list(BUCKET_BOUNDS))
    except TypeError:  # API older than 1.23: no bucket advice
        histogram = meter.create_histogram(f"{prefix}.duration", unit="s",
                                           description="operation latency")

    def on_record(op: str, seconds: float, nbytes: int, error: BaseException | None) -> None:
        attrs = {**base, "op": op}
        if error is not None:
            attrs["error.type"] = type(error).__name__
        histogram.record(seconds, attrs)

    stats.add_listener(on_record)
    instruments.append(histogram)
    return instruments
