"""lmkv_async.metrics without a server: counters, histograms, in-flight gauges, the OTel bridge."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import threading
from typing import Any

import pytest

import lmkv_async
from lmkv_async.metrics import BUCKET_BOUNDS, LatencyHistogram, OpStats, register_otel


def test_buckets_are_log_spaced_from_100us_to_100s() -> None:
    assert BUCKET_BOUNDS[0] == pytest.approx(1e-4)
    assert BUCKET_BOUNDS[-1] == pytest.approx(100.0)
    ratios = {round(b / a, 9) for a, b in itertools.pairwise(BUCKET_BOUNDS)}
    assert ratios == {round(10 ** 0.25, 9)}


def test_histogram_places_values_in_the_right_bucket() -> None:
    h = LatencyHistogram([1.0, 2.0, 4.0])
    for v in (0.5, 1.0, 1.5, 2.0, 3.0, 9.0, -1.0):
        h.observe(v)
    # (..1], (1..2], (2..4], (4..inf): bounds are inclusive upper bounds; -1 counts as 0
    assert h.counts == [3, 2, 1, 1]
    assert h.count == 7
    assert h.min == 0.0 and h.max == 9.0
    assert h.sum == pytest.approx(0.5 + 1 + 1.5 + 2 + 3 + 9)


def test_histogram_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        LatencyHistogram([])
    with pytest.raises(ValueError):
        LatencyHistogram([1.0, 1.0])
    with pytest.raises(ValueError):
        LatencyHistogram([1.0]).quantile(1.5)


def test_quantiles_are_within_one_bucket_and_exact_at_the_ends() -> None:
    rng = random.Random(7)
    values = [10 ** rng.uniform(-3.5, 0.5) for _ in range(5000)]
    h = LatencyHistogram()
    for v in values:
        h.observe(v)
    values.sort()
    step = 10 ** 0.25
    for q in (0.1, 0.5, 0.9, 0.99):
        exact = values[min(len(values) - 1, int(q * len(values)))]
        est = h.quantile(q)
        assert est is not None
        assert exact / step <= est <= exact * step, (q, exact, est)
    assert h.quantile(0.0) == pytest.approx(values[0])
    assert h.quantile(1.0) == pytest.approx(values[-1])
    assert LatencyHistogram().quantile(0.5) is None


def test_record_counts_successes_errors_timeouts_and_cancellations() -> None:
    stats = OpStats()
    stats.record("store", 0.01, 1000)
    stats.record("store", 0.02, 500)
    stats.record("store", 5.0, 999, lmkv_async.ServerTimeoutError("no reply", timeout=5.0))
    stats.record("store", 0.001, 7, lmkv_async.InvalidInputError("bad"))
    stats.record("store", 0.5, 3, asyncio.CancelledError())
    s = stats.snapshot()["ops"]["store"]
    assert s["count"] == 5
    assert s["bytes"] == 1500  # only successful calls move bytes
    assert s["errors"] == 2
    assert s["timeouts"] == 1
    assert s["cancelled"] == 1
    assert s["errors_by_type"] == {"InvalidInputError": 1, "ServerTimeoutError": 1}
    assert s["latency"]["count"] == 5
    assert s["latency"]["max"] == pytest.approx(5.0)
    assert s["latency"]["min"] == pytest.approx(0.001)


def test_plain_timeout_error_counts_as_timeout() -> None:
    stats = OpStats()
    stats.record("lookup", 1.0, error=TimeoutError())
    assert stats.totals("lookup")["timeouts"] == 1
    assert stats.totals("lookup")["errors"] == 1


def test_snapshot_has_default_ops_and_new_ones_and_is_json_ready() -> None:
    stats = OpStats()
    snap = stats.snapshot()
    assert set(snap["ops"]) == {"store", "retrieve", "lookup"}
    assert snap["ops"]["retrieve"]["latency"]["p50"] is None
    stats.record("store_blocks", 0.1, 10)
    snap = stats.snapshot()
    assert "store_blocks" in snap["ops"]
    buckets = snap["ops"]["store_blocks"]["latency"]["buckets"]
    assert len(buckets) == len(BUCKET_BOUNDS) + 1
    assert math.isinf(buckets[-1][0])
    assert sum(n for _, n in buckets) == 1
    json.dumps(snap)  # inf is written as Infinity; nothing else needs converting


def test_snapshot_is_a_copy() -> None:
    stats = OpStats()
    snap = stats.snapshot()
    stats.record("lookup", 0.1)
    assert snap["ops"]["lookup"]["count"] == 0
    assert stats.snapshot()["ops"]["lookup"]["count"] == 1


def test_in_flight_counts_while_inside_and_undoes_on_error() -> None:
    stats = OpStats()
    with stats.in_flight("retrieve"):
        with stats.in_flight("retrieve"):
            assert stats.totals("retrieve")["in_flight"] == 2
        assert stats.totals("retrieve")["in_flight"] == 1
    assert stats.totals("retrieve")["in_flight"] == 0
    with pytest.raises(RuntimeError), stats.in_flight("retrieve"):
        raise RuntimeError("boom")
    assert stats.totals("retrieve")["in_flight"] == 0


def test_measure_times_records_bytes_and_reraises() -> None:
    stats = OpStats()
    with stats.measure("retrieve") as m:
        assert stats.totals("retrieve")["in_flight"] == 1
        m.nbytes = 4096
    with pytest.raises(lmkv_async.ServerUnavailableError), stats.measure("retrieve") as m:
        m.nbytes = 1  # not counted: the call failed
        raise lmkv_async.ServerUnavailableError("gone")
    t = stats.totals("retrieve")
    assert (t["count"], t["errors"], t["bytes"], t["in_flight"]) == (2, 1, 4096, 0)
    assert stats.snapshot()["ops"]["retrieve"]["errors_by_type"] == {"ServerUnavailableError": 1}


def test_measure_counts_a_cancelled_task() -> None:
    stats = OpStats()

    async def op() -> None:
        with stats.measure("lookup"):
            await asyncio.sleep(10)

    async def main() -> None:
        task = asyncio.create_task(op())
        await asyncio.sleep(0.01)
        assert stats.totals("lookup")["in_flight"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    t = stats.totals("lookup")
    assert (t["count"], t["cancelled"], t["errors"], t["in_flight"]) == (1, 1, 0, 0)


def test_threads_do_not_lose_counts() -> None:
    stats = OpStats()

    def work() -> None:
        for _ in range(2000):
            with stats.measure("store") as m:
                m.nbytes = 2

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t = stats.totals("store")
    assert t["count"] == 8000 and t["bytes"] == 16000 and t["in_flight"] == 0


def test_listeners_and_reset() -> None:
    stats = OpStats()
    seen: list[tuple[str, float, int, str | None]] = []

    def listener(op: str, s: float, n: int, e: BaseException | None) -> None:
        seen.append((op, s, n, type(e).__name__ if e else None))

    stats.add_listener(listener)
    stats.record("lookup", 0.5, 0, KeyError("x"))
    stats.remove_listener(listener)
    stats.remove_listener(listener)  # harmless twice
    stats.record("lookup", 0.5)
    assert seen == [("lookup", 0.5, 0, "KeyError")]
    with stats.in_flight("custom"):
        stats.reset()
        assert stats.totals("lookup")["count"] == 0
        assert stats.totals("custom")["in_flight"] == 1
    assert stats.totals("custom")["in_flight"] == 0


def test_bad_op_name() -> None:
    with pytest.raises(ValueError):
        OpStats().record("", 0.1)


def test_otel_bridge_exports_counters_gauge_and_histogram() -> None:
    pytest.importorskip("opentelemetry.sdk.metrics")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    meter = provider.get_meter("test")
    stats = OpStats()
    register_otel(stats, meter, attributes={"server": "tcp://127.0.0.1:1"})
    stats.record("store", 0.01, 100)
    stats.record("store", 0.02, 50)
    stats.record("lookup", 3.0, 0, lmkv_async.ServerTimeoutError("t"))
    with stats.in_flight("retrieve"):
        data = reader.get_metrics_data()
    points: dict[str, list[object]] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                points[metric.name] = list(metric.data.data_points)

    def value(name: str, **attrs: str) -> object:
        for p in points[name]:
            a = dict(p.attributes)  # type: ignore[attr-defined]
            if all(a.get(k) == v for k, v in attrs.items()):
                return p.value  # type: ignore[attr-defined]
        raise AssertionError(f"no {name} point with {attrs}")

    assert value("lmkv.operations", op="store", server="tcp://127.0.0.1:1") == 2
    assert value("lmkv.bytes", op="store") == 150
    assert value("lmkv.timeouts", op="lookup") == 1
    assert value("lmkv.errors", op="lookup", **{"error.type": "ServerTimeoutError"}) == 1
    assert value("lmkv.in_flight", op="retrieve") == 1
    hist = [p for p in points["lmkv.duration"]
            if dict(p.attributes).get("op") == "store"]  # type: ignore[attr-defined]
    assert hist and hist[0].count == 2  # type: ignore[attr-defined]
    assert hist[0].sum == pytest.approx(0.03)  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_context_stats_count_real_operations(server_factory: Any) -> None:
    """ctx.stats() counts calls, bytes and errors of a real context, by operation."""
    from test_context import LAYOUT, random_kv, tokens_for

    import lmkv_async as lmkv

    server = server_factory("0.5.6")
    async with lmkv.connect(server.url, server.http_url, "stats", layout=LAYOUT) as ctx:
        C = ctx.chunk_size
        toks = tokens_for(2 * C)
        await ctx.store(random_kv(LAYOUT, 2 * C, seed=1), toks)
        assert await ctx.retrieve(toks) is not None
        assert await ctx.lookup(toks) == 2 * C
        with pytest.raises(lmkv.ServerTimeoutError):
            await ctx.lookup(toks, timeout=1e-9)
        ops = ctx.stats()["ops"]
    chunk_bytes = C * LAYOUT.token_bytes()
    assert ops["store"]["count"] == 1 and ops["store"]["bytes"] == 2 * chunk_bytes
    assert ops["retrieve"]["count"] == 1 and ops["retrieve"]["bytes"] == 2 * chunk_bytes
    assert ops["lookup"]["count"] == 2 and ops["lookup"]["timeouts"] == 1
    assert ops["lookup"]["errors_by_type"] == {"ServerTimeoutError": 1}
