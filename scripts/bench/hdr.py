"""Latency percentiles through an HDR histogram (µs, 3 significant digits, up to 1 hour)."""

from __future__ import annotations

from collections.abc import Iterable

from hdrh.histogram import HdrHistogram

LOWEST_US, HIGHEST_US, DIGITS = 1, 3_600_000_000, 3
# celery-benchmark's names -> quantiles
SUMMARY = {"p50": 50.0, "p75": 75.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "p99_9": 99.9,
           "p99_99": 99.99}
PER_SECOND = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p999": 99.9}


def histogram(values_us: Iterable[float]) -> HdrHistogram:
    hist = HdrHistogram(LOWEST_US, HIGHEST_US, DIGITS)
    for value in values_us:
        hist.record_value(min(HIGHEST_US, max(LOWEST_US, round(value))))
    return hist


def summary(values_us: Iterable[float]) -> dict[str, float]:
    """celery-benchmark's ``latency_us`` object: p50 ... p99_99, max, mean, total_count."""
    hist = histogram(values_us)
    if hist.get_total_count() == 0:
        return {**dict.fromkeys(SUMMARY, 0), "max": 0, "mean": 0.0, "total_count": 0}
    out: dict[str, float] = {name: hist.get_value_at_percentile(q) for name, q in SUMMARY.items()}
    out["max"] = hist.get_max_value()
    out["mean"] = round(hist.get_mean_value(), 1)
    out["total_count"] = hist.get_total_count()
    return out


def per_second(values_us: Iterable[float]) -> dict[str, float]:
    """One second's entry of ``latency_per_sec_us`` (p50, p90, p99, p999, max)."""
    hist = histogram(values_us)
    if hist.get_total_count() == 0:
        return {**dict.fromkeys(PER_SECOND, 0), "max": 0}
    return {**{name: hist.get_value_at_percentile(q) for name, q in PER_SECOND.items()},
            "max": hist.get_max_value()}
