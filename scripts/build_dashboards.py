"""Generate the Grafana dashboards in grafana/dashboards/ from one description.

Every panel and its PromQL is written once below; the JSON files are output,
committed, and checked for drift by tests/test_deploy.py. Run it after editing:
`python scripts/build_dashboards.py` (or `--check` to fail on drift).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent.parent / "grafana" / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
ANNOTATIONS = {"builtIn": 1, "type": "dashboard", "name": "Annotations & Alerts",
               "datasource": {"type": "grafana", "uid": "-- Grafana --"},
               "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)"}


def sel(name: str, extra: str = "") -> str:
    """A series selector restricted to the daemons chosen in the dashboard."""
    matchers = 'instance=~"$instance"' + (f", {extra}" if extra else "")
    return f"{name}{{{matchers}}}"


def quantile(q: float, hist: str, by: str = "", window: str = RATE) -> str:
    """PromQL for the q-quantile of a histogram over all chosen daemons."""
    labels = ", ".join(["le", *([by] if by else [])])
    return f"histogram_quantile({q}, sum by ({labels}) (rate({sel(hist + '_bucket')}[{window}])))"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str  # timeseries | stat | table | bargauge | state-timeline
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""
    width: int = 12
    height: int = 8
    # (value, colour) steps, lowest first; the first value is ignored (base).
    thresholds: tuple[tuple[float | None, str], ...] = ((None, "green"),)


@dataclass(frozen=True)
class Row:
    title: str


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    items: tuple[Panel | Row, ...]


Q = Query
RED_AT_0 = ((None, "red"), (1, "orange"), (2, "green"))

OVERVIEW = Dashboard("stalwart-overview", "Stalwart / Overview",
    "Is the job protected, committing, and are its ranks healthy?", (
    Row("Protection"),
    Panel("Protection margin", "stat",
          (Q(f"min({sel('stalwart_protection_margin_nodes')})", "nodes", instant=True),),
          description="More node losses the newest committed step survives (min over daemons). "
                      "0 means the next loss loses committed state.",
          width=6, height=5, thresholds=RED_AT_0),
    Panel("Last committed step", "stat",
          (Q(f"max({sel('stalwart_last_committed_step')})", "step", instant=True),),
          width=6, height=5),
    Panel("Generation", "stat",
          (Q(f"max({sel('stalwart_generation')})", "generation", instant=True),),
          description="Bumped by every failure or plan change.", width=6, height=5),
    Panel("Commits per minute", "stat",
          (Q(f"sum(rate({sel('stalwart_commits_total')}[{RATE}])) * 60", "commits/min"),),
          width=6, height=5),
    Panel("Parallel plan", "table",
          (Q(sel("stalwart_plan_info"), instant=True),),
          description="Labels of the current plan as each daemon reports it.",
          width=24, height=5),
    Row("Training"),
    Panel("Capture stall p50 / p99", "timeseries",
          (Q(quantile(0.5, "stalwart_capture_stall_seconds"), "p50"),
           Q(quantile(0.99, "stalwart_capture_stall_seconds"), "p99")),
          unit="s", description="Time a step waited for the previous capture to finish."),
    Panel("Step time per rank", "timeseries",
          (Q(f"max by (rank) ({sel('stalwart_step_time_seconds')})", "rank {{rank}}"),),
          unit="s"),
    Panel("Training step per rank", "timeseries",
          (Q(f"max by (rank) ({sel('stalwart_training_step')})", "rank {{rank}}"),)),
    Panel("Capture-to-commit latency p50 / p99", "timeseries",
          (Q(quantile(0.5, "stalwart_commit_seconds"), "p50"),
           Q(quantile(0.99, "stalwart_commit_seconds"), "p99")), unit="s"),
    Panel("Bytes sent by link and collective", "timeseries",
          (Q(f"sum by (link, collective) (rate({sel('stalwart_link_bytes_total')}[{RATE}]))",
             "{{link}} {{collective}}"),),
          unit="Bps", width=24,
          description="What the ranks' collectives send (ring volume), inside a node "
                      "(intra) or between nodes (inter); a good placement keeps inter low."),
    Row("Membership"),
    Panel("Ranks by state", "timeseries",
          (Q(f"sum by (state) ({sel('stalwart_ranks')})", "{{state}}"),)),
    Panel("Peer daemons by state", "timeseries",
          (Q(f"sum by (state) ({sel('stalwart_peers')})", "{{state}}"),)),
    Row("Daemon resources"),
    Panel("Daemon CPU", "timeseries",
          (Q(f"rate({sel('process_cpu_seconds_total')}[{RATE}])", "{{instance}}"),),
          unit="percentunit"),
    Panel("Daemon memory (RSS)", "timeseries",
          (Q(sel("process_resident_memory_bytes"), "{{instance}}"),), unit="bytes"),
))

FAULTS = Dashboard("stalwart-faults", "Stalwart / Faults and recoveries",
    "What failed, how the job recovered, and how long each phase took.", (
    Row("Failures"),
    Panel("Failures detected by kind", "timeseries",
          (Q(f"sum by (kind) (increase({sel('stalwart_failures_detected_total')}[{RATE}]))",
             "{{kind}}"),),
          width=16),
    Panel("Failures since start by kind", "bargauge",
          (Q(f"sum by (kind) ({sel('stalwart_failures_detected_total')})", "{{kind}}",
             instant=True),),
          width=8),
    Panel("Rank heartbeats per second", "timeseries",
          (Q(f"sum by (instance) (rate({sel('stalwart_heartbeats_total')}[{RATE}]))",
             "{{instance}}"),), unit="ops"),
    Panel("Refused callers by reason", "timeseries",
          (Q(f"sum by (reason) (increase({sel('stalwart_auth_refused_total')}[{RATE}]))",
             "{{reason}}"),)),
    Row("Recoveries"),
    Panel("Recoveries by outcome", "timeseries",
          (Q(f"sum by (outcome) (increase({sel('stalwart_recoveries_total')}[{RATE}]))",
             "{{outcome}}"),)),
    Panel("Generation", "timeseries",
          (Q(f"max({sel('stalwart_generation')})", "generation"),)),
    Panel("Recovery phase p90", "timeseries",
          (Q(quantile(0.9, "stalwart_recovery_phase_seconds", by="phase"), "{{phase}}"),),
          unit="s", description="detect, decide, rebuild, restore, resume."),
    Panel("Mean phase duration over the time range", "bargauge",
          (Q(f"sum by (phase) (increase({sel('stalwart_recovery_phase_seconds_sum')}[$__range]))"
             f" / sum by (phase) (increase({sel('stalwart_recovery_phase_seconds_count')}"
             f"[$__range]))", "{{phase}}", instant=True),),
          unit="s"),
    Row("Plan changes"),
    Panel("Plan changes by kind", "timeseries",
          (Q(f"sum by (kind) (increase({sel('stalwart_plan_changes_total')}[{RATE}]))",
             "{{kind}}"),)),
    Panel("Layers moved by plan changes", "timeseries",
          (Q(f"sum(increase({sel('stalwart_layers_moved_total')}[{RATE}]))", "layers"),)),
    Row("Stragglers"),
    Panel("Straggler flags", "state-timeline",
          (Q(f"max by (rank) ({sel('stalwart_straggler')})", "rank {{rank}}"),),
          thresholds=((None, "green"), (1, "red"))),
    Panel("Step time relative to the median rank", "timeseries",
          (Q(f"max by (rank) ({sel('stalwart_step_time_seconds')}) / scalar(quantile(0.5, "
             f"max by (rank) ({sel('stalwart_step_time_seconds')})))", "rank {{rank}}"),),
          unit="percentunit"),
))

STORAGE = Dashboard("stalwart-storage", "Stalwart / Storage and erasure coding",
    "Snapshot volume, shard health, coder speed and the remote tiers.", (
    Row("Volume"),
    Panel("Bytes captured and stored per second", "timeseries",
          (Q(f"sum(rate({sel('stalwart_captured_bytes_total')}[{RATE}]))", "captured"),
           Q(f"sum by (tier) (rate({sel('stalwart_stored_bytes_total')}[{RATE}]))",
             "stored {{tier}}")),
          unit="Bps"),
    Panel("Compression ratio (captured / encoded)", "timeseries",
          (Q(sel("stalwart_compression_ratio"), "{{instance}}"),), unit="none"),
    Row("Shards"),
    Panel("Shards by state", "timeseries",
          (Q(f"sum by (state) ({sel('stalwart_shards')})", "{{state}}"),), width=8),
    Panel("Repair pending", "timeseries",
          (Q(f"sum({sel('stalwart_repair_pending_shards')})", "pending"),), width=8),
    Panel("Shards repaired and scrub errors", "timeseries",
          (Q(f"sum(increase({sel('stalwart_repaired_shards_total')}[{RATE}]))", "repaired"),
           Q(f"sum by (tier) (increase({sel('stalwart_scrub_errors_total')}[{RATE}]))",
             "scrub errors {{tier}}")),
          width=8),
    Row("Erasure coder"),
    Panel("Coder throughput", "timeseries",
          (Q(f"sum by (op) (rate({sel('stalwart_coder_bytes_total')}[{RATE}]))", "{{op}}"),),
          unit="Bps"),
    Panel("Coder speed while busy", "timeseries",
          (Q(f"sum by (op) (rate({sel('stalwart_coder_bytes_total')}[{RATE}])) / "
             f"sum by (op) (rate({sel('stalwart_coder_seconds_total')}[{RATE}]))", "{{op}}"),),
          unit="Bps", description="Bytes per second of coder time (not wall time)."),
    Row("Remote tiers"),
    Panel("S3 latency p50 / p99 by operation", "timeseries",
          (Q(quantile(0.5, "stalwart_s3_request_seconds", by="op"), "p50 {{op}}"),
           Q(quantile(0.99, "stalwart_s3_request_seconds", by="op"), "p99 {{op}}")),
          unit="s"),
    Panel("S3 errors by operation and code", "timeseries",
          (Q(f"sum by (op, code) (increase({sel('stalwart_s3_errors_total')}[{RATE}]))",
             "{{op}} {{code}}"),)),
    Panel("Peer transfer latency p99", "timeseries",
          (Q(quantile(0.99, "stalwart_peer_request_seconds", by="op"), "{{op}}"),), unit="s"),
    Panel("Peer transfer errors", "timeseries",
          (Q(f"sum by (peer, op) (increase({sel('stalwart_peer_errors_total')}[{RATE}]))",
             "{{peer}} {{op}}"),)),
))

DASHBOARDS = {"overview": OVERVIEW, "faults": FAULTS, "storage": STORAGE}


def _thresholds(steps: tuple[tuple[float | None, str], ...]) -> dict:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


def _options(kind: str) -> dict:
    if kind == "stat":
        return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "background", "graphMode": "none", "textMode": "value"}
    if kind == "bargauge":
        return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "orientation": "horizontal", "displayMode": "gradient"}
    if kind == "table":
        return {"showHeader": True}
    return {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"}}


def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict:
    targets = [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": q.expr,
                "legendFormat": q.legend, "instant": q.instant, "range": not q.instant,
                **({"format": "table"} if panel.kind == "table" else {})}
               for i, q in enumerate(panel.queries)]
    colour = "thresholds" if panel.kind in ("stat", "state-timeline") else "palette-classic"
    defaults = {"unit": panel.unit, "thresholds": _thresholds(panel.thresholds),
                "color": {"mode": colour}}
    out = {"id": pid, "type": panel.kind, "title": panel.title, "description": panel.description,
           "datasource": DATASOURCE,
           "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
           "fieldConfig": {"defaults": defaults, "overrides": []},
           "options": _options(panel.kind), "targets": targets}
    if panel.kind == "table":
        out["transformations"] = [{"id": "labelsToFields", "options": {}}]
    return out


def _templating() -> dict:
    return {"list": [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1},
        {"name": "instance", "label": "Daemon", "type": "query", "datasource": DATASOURCE,
         "query": {"query": "label_values(stalwart_generation, instance)", "refId": "instance"},
         "definition": "label_values(stalwart_generation, instance)", "refresh": 2,
         "includeAll": True, "multi": True, "allValue": ".*", "hide": 0,
         "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
         "sort": 1},
    ]}


def render(dash: Dashboard) -> dict:
    """The Grafana JSON model of one dashboard; panels flow left to right, 24 columns wide."""
    panels, x, y, row_h = [], 0, 0, 0
    for pid, item in enumerate(dash.items, start=1):
        if isinstance(item, Row):
            y += row_h
            panels.append({"id": pid, "type": "row", "title": item.title, "collapsed": False,
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
            x, y, row_h = 0, y + 1, 0
            continue
        if x + item.width > 24:
            x, y, row_h = 0, y + row_h, 0
        panels.append(_panel_json(item, pid, x, y))
        x, row_h = x + item.width, max(row_h, item.height)
    return {
        "uid": dash.uid, "title": dash.title, "description": dash.description,
        "tags": ["stalwart"], "timezone": "utc", "schemaVersion": 39, "version": 1,
        "editable": True, "graphTooltip": 1, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": [ANNOTATIONS]},
        "links": [{"type": "dashboards", "tags": ["stalwart"], "title": "Stalwart",
                   "asDropdown": True, "includeVars": True, "keepTime": True}],
        "templating": _templating(), "panels": panels,
    }


def dump(dash: Dashboard) -> str:
    return json.dumps(render(dash), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the JSON files are stale")
    args = parser.parse_args(argv)
    stale = []
    for name, dash in DASHBOARDS.items():
        path = OUT_DIR / f"{name}.json"
        text = dump(dash)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if stale:
        print("stale dashboards (run python scripts/build_dashboards.py): " + ", ".join(stale),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
