"""Prometheus's HTTP API as the dashboard scripts and the scrape test ask it: no
plotting, so a caller that only asks (start-up checks, tests) imports nothing heavy."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request


class PrometheusError(RuntimeError):
    """Prometheus could not be reached or refused a query."""


def api(base: str, path: str, timeout_s: float = 30.0, **params: str) -> dict:
    """The `data` of /api/v1/`path`; PrometheusError names what failed."""
    url = f"{base.rstrip('/')}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = json.loads(response.read())
    except (urllib.error.URLError, OSError) as e:
        raise PrometheusError(f"cannot reach Prometheus at {base} ({e}); check --prometheus") from e
    if body.get("status") != "success":
        raise PrometheusError(f"Prometheus refused {params.get('query', path)}: {body}")
    return body["data"]


def scraped_all(base: str, targets: list[str]) -> bool:
    """Prometheus at `base` has scraped every one of `targets` (HOST:PORT), and the last
    scrape of each succeeded."""
    active = api(base, "targets", timeout_s=2, state="active")["activeTargets"]
    up = {t["labels"].get("instance") for t in active if t.get("health") == "up"}
    return set(targets) <= up


def range_query(base: str, expr: str, start: float, end: float, step_s: float
                ) -> list[dict]:
    """Series of a range query that carry at least one number (NaN is no data)."""
    found = api(base, "query_range", timeout_s=10, query=expr, start=f"{start:.3f}",
                end=f"{end:.3f}", step=f"{step_s:g}")["result"]
    return [s for s in found if any(not math.isnan(float(v)) for _, v in s["values"])]
