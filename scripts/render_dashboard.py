"""Render a Grafana dashboard's panels from Prometheus data into a PNG, without Grafana.

Each panel's queries (from grafana/dashboards/NAME.json) are asked for as range
queries over the last minutes and drawn with matplotlib in the dashboard's grid:
    python scripts/render_dashboard.py --prometheus http://127.0.0.1:9090 \
        --out docs/overview-dashboard.png [--minutes 15] [--dashboard overview]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402
from prometheus_api import PrometheusError, api  # noqa: E402

DASHBOARDS = Path(__file__).resolve().parent.parent / "grafana" / "dashboards"
GRID_ROW_INCHES = 0.32  # height of one Grafana grid unit
WIDTH_INCHES = 18.0
POINTS = 240  # samples per series across the range
UNIT_SCALE = {"bytes": (2**20, "MiB"), "Bps": (2**20, "MiB/s"), "percentunit": (0.01, "%"),
              "s": (1, "s"), "ops": (1, "/s")}
Series = tuple[str, list[tuple[float, float]]]


def scrape_interval_s(base: str) -> float:
    """The global scrape interval (seconds), as Grafana uses it for $__rate_interval."""
    config = yaml.safe_load(api(base, "status/config")["yaml"]) or {}
    return _seconds(config.get("global", {}).get("scrape_interval", "1m"))


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", duration))


def concrete(expr: str, rate_s: float, range_s: float) -> str:
    """Fill in Grafana's variables as Grafana would for all daemons."""
    return (expr.replace("$__rate_interval", f"{max(1, round(rate_s))}s")
            .replace("$__range", f"{max(1, round(range_s))}s").replace("$instance", ".*"))


def legend(template: str, labels: dict[str, str]) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
    return text or ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__")


def fetch(base: str, panel: dict, start: float, end: float, step: float,
          scrape_s: float) -> list[Series]:
    rate_s = max(step + scrape_s, 4 * scrape_s)
    out: list[Series] = []
    for target in panel.get("targets", []):
        expr = concrete(target["expr"], rate_s, end - start)
        data = api(base, "query_range", query=expr, start=str(start), end=str(end),
                   step=str(step))
        for series in data["result"]:
            points = [(float(t), float(v)) for t, v in series["values"]
                      if not math.isnan(float(v))]
            if points:
                out.append((legend(target.get("legendFormat", ""), series["metric"]), points))
    return out


def draw_stat(ax: plt.Axes, panel: dict, series: list[Series], scale: float, unit: str) -> None:
    ax.set_axis_off()
    if not series:
        ax.text(0.5, 0.45, "no data", ha="center", va="center", fontsize=14, color="grey")
        return
    value = series[0][1][-1][1] / scale
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    colour = steps[0]["color"]
    for s in steps[1:]:
        if value >= s["value"]:
            colour = s["color"]
    ax.add_patch(plt.Rectangle((0, 0), 1, 0.85, transform=ax.transAxes, color=colour, alpha=0.3))
    text = f"{value:.0f}" if float(value).is_integer() else f"{value:.3g}"
    ax.text(0.5, 0.42, f"{text} {unit}".strip(), ha="center", va="center", fontsize=22,
            weight="bold")


def draw_table(ax: plt.Axes, series: list[Series]) -> None:
    ax.set_axis_off()
    lines = [name for name, _ in series] or ["no data"]
    ax.text(0.01, 0.8, "\n".join(lines[:4]), va="top", family="monospace", fontsize=9)


def draw_series(ax: plt.Axes, series: list[Series], scale: float, unit: str,
                start: float, end: float) -> None:
    ax.set_xlim(datetime.fromtimestamp(start, UTC), datetime.fromtimestamp(end, UTC))
    if not series:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes,
                color="grey")
    for name, points in series:
        times = [datetime.fromtimestamp(t, UTC) for t, _ in points]
        ax.plot(times, [v / scale for _, v in points], label=name, linewidth=1.4)
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.tick_params(labelsize=8)
    ax.set_ylabel(unit, fontsize=8)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=7, loc="upper left", ncol=min(4, len(series)))


def render(base: str, dashboard: str, out: Path, minutes: float, end: float | None) -> int:
    """Draw every panel of `dashboard`; returns how many panels had data."""
    model = json.loads((DASHBOARDS / f"{dashboard}.json").read_text())
    end = time.time() if end is None else end
    start = end - minutes * 60
    step = max(1.0, (end - start) / POINTS)
    scrape_s = scrape_interval_s(base)
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in model["panels"])
    fig = plt.figure(figsize=(WIDTH_INCHES, rows * GRID_ROW_INCHES + 0.8))
    grid = fig.add_gridspec(rows, 24, hspace=0.0, wspace=1.5, top=0.97, bottom=0.02)
    with_data = 0
    for panel in model["panels"]:
        g = panel["gridPos"]
        if panel["type"] == "row":
            ax = fig.add_subplot(grid[g["y"], :])
            ax.set_axis_off()
            ax.text(0, 0.2, panel["title"], fontsize=12, weight="bold", transform=ax.transAxes)
            continue
        # The top grid unit holds the title, the bottom one the time axis labels.
        ax = fig.add_subplot(grid[g["y"] + 1:g["y"] + g["h"] - 1, g["x"]:g["x"] + g["w"]])
        ax.set_title(panel["title"], fontsize=10, loc="left")
        series = fetch(base, panel, start, end, step, scrape_s)
        with_data += bool(series)
        scale, unit = UNIT_SCALE.get(panel["fieldConfig"]["defaults"].get("unit", ""), (1, ""))
        if panel["type"] == "stat":
            draw_stat(ax, panel, series, scale, unit)
        elif panel["type"] == "table":
            draw_table(ax, series)
        else:
            draw_series(ax, series, scale, unit, start, end)
    window = (f"{datetime.fromtimestamp(start, UTC):%Y-%m-%d %H:%M:%S} - "
              f"{datetime.fromtimestamp(end, UTC):%H:%M:%S} UTC")
    fig.suptitle(f"{model['title']}   ({window})", fontsize=14, x=0.12, y=1.0, ha="left")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return with_data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--out", type=Path, required=True, help="PNG file to write")
    parser.add_argument("--dashboard", default="overview", help="overview, faults or storage")
    parser.add_argument("--minutes", type=float, default=15.0, help="time range before --end")
    parser.add_argument("--end", type=float, default=None, help="end as Unix seconds (now)")
    args = parser.parse_args(argv)
    try:
        with_data = render(args.prometheus, args.dashboard, args.out, args.minutes, args.end)
    except PrometheusError as e:
        print(f"render_dashboard: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({with_data} panels with data)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
