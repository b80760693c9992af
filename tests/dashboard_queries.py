"""Read the committed Grafana dashboards and alert rules as plain PromQL for the tests.

Shared by test_deploy.py (static checks with promtool) and test_prometheus_scrape.py
(queries against a live Prometheus).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from stalwart.daemon.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = ROOT / "grafana" / "dashboards"
RULES = ROOT / "grafana" / "alerts" / "stalwart-rules.yml"
DASHBOARDS = ("overview", "faults", "storage")
# Series names in PromQL: ours, and the process collector's that metrics.py registers.
METRIC_NAME = re.compile(r"\b(?:stalwart|process)_[a-zA-Z0-9_]*")
_SUFFIXES = {"counter": ("_total", "_created"),
             "histogram": ("_bucket", "_count", "_sum", "_created"),
             "gauge": ("",), "info": ("_info",)}


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref_id: str
    expr: str  # as written in the dashboard, with Grafana variables


def panel_queries(names: tuple[str, ...] = DASHBOARDS) -> list[PanelQuery]:
    """Every target of every panel, in dashboard order."""
    out = []
    for name in names:
        model = json.loads((DASHBOARD_DIR / f"{name}.json").read_text())
        for panel in model["panels"]:
            for target in panel.get("targets", []):
                out.append(PanelQuery(name, panel["title"], target["refId"], target["expr"]))
    return out


def concrete(expr: str, window: str = "1m") -> str:
    """Replace Grafana's variables by what Grafana would send: all daemons, one window."""
    return (expr.replace("$__rate_interval", window).replace("$__range", window)
            .replace("$instance", ".*"))


def alert_exprs() -> dict[str, str]:
    """Alert name -> expression from the rules file."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule["expr"] for g in groups for rule in g["rules"]}


def metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


def exported_series_names() -> set[str]:
    """Every sample name the daemon's registry can export, label children or not."""
    names = set()
    for family in Metrics().registry.collect():
        names.update(family.name + s for s in _SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names
