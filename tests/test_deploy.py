"""Deployment artefacts pass the tools operators will run them through.

systemd-analyze (unit), kubernetes-validate --strict (manifests), promtool (alert
rules, their unit tests, every dashboard query), and the daemon's own config loader.
A missing tool fails the test: scripts/install-system-deps.sh installs them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from dashboard_queries import (
    DASHBOARD_DIR,
    DASHBOARDS,
    ROOT,
    RULES,
    alert_exprs,
    concrete,
    exported_series_names,
    metric_names,
    panel_queries,
)

from stalwart.daemon.config import DaemonConfig, load_config
from stalwart.daemon.config_schema import SCHEMA, default
from stalwart.daemon.metrics import Metrics

UNIT = ROOT / "deploy" / "systemd" / "stalwart.service"
EXAMPLE_TOML = ROOT / "deploy" / "systemd" / "stalwart.toml"
K8S = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """Path of a command-line tool, or fail naming the package that provides it."""
    path = shutil.which(name) or shutil.which(name, path=str(VENV_BIN))
    if path is None:
        pytest.fail(f"{name} is not installed; run scripts/install-system-deps.sh "
                    "(Debian packages prometheus, systemd) or pip install -e '.[dev]'")
    return path


def run(*cmd: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=cwd)


def unit_settings() -> dict[str, list[str]]:
    """[Service] settings of the unit; repeated keys keep every value."""
    settings: dict[str, list[str]] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def k8s_docs() -> list[dict]:
    return [d for path in K8S for d in yaml.safe_load_all(path.read_text()) if d]


def find(kind: str, name: str) -> dict:
    matches = [d for d in k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def test_systemd_unit_verifies_without_any_output(tmp_path: Path) -> None:
    # verify insists that ExecStart exists; point it at this checkout's entry point.
    stalwart = shutil.which("stalwart", path=str(VENV_BIN)) or tool("stalwart")
    unit = tmp_path / "stalwart.service"
    unit.write_text(UNIT.read_text().replace("/usr/bin/stalwart", stalwart))
    result = run(tool("systemd-analyze"), "verify", str(unit))
    assert result.returncode == 0 and result.stdout + result.stderr == "", (
        result.stdout + result.stderr)


def test_systemd_unit_is_hardened_and_runs_the_daemon() -> None:
    s = unit_settings()
    assert s["ExecStart"] == ["/usr/bin/stalwart daemon --config /etc/stalwart/stalwart.toml"]
    expected = {
        "DynamicUser": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
        "PrivateTmp": "yes", "NoNewPrivileges": "yes", "CapabilityBoundingSet": "",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6", "StateDirectory": "stalwart",
        "RuntimeDirectory": "stalwart", "MemoryDenyWriteExecute": "yes",
        "Restart": "on-failure",
    }
    for key, value in expected.items():
        assert s.get(key) == [value], f"{key}={s.get(key)}"
    assert "@system-service" in s["SystemCallFilter"]
    assert int(s["LimitNOFILE"][0]) >= 4096
    assert s["TimeoutStopSec"]


def shipped_configs() -> dict[str, str]:
    """Every daemon configuration under deploy/: TOML files and ConfigMaps' TOML entries."""
    found = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "deploy").rglob("*.toml")}
    for d in k8s_docs():
        if d["kind"] == "ConfigMap":
            found.update({f"ConfigMap {d['metadata']['name']}: {name}": text
                          for name, text in d["data"].items() if name.endswith(".toml")})
    return found


def configmap_config(tmp_path: Path) -> DaemonConfig:
    path = tmp_path / "stalwart.toml"
    path.write_text(find("ConfigMap", "stalwart-config")["data"]["stalwart.toml"])
    return load_config(path, env={})


def test_deploy_ships_the_systemd_example_and_the_configmap() -> None:
    assert set(shipped_configs()) == {"deploy/systemd/stalwart.toml",
                                      "ConfigMap stalwart-config: stalwart.toml"}


@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_shipped_config_is_accepted_by_the_daemon(name: str, tmp_path: Path) -> None:
    path = tmp_path / "stalwart.toml"
    path.write_text(shipped_configs()[name])
    config = load_config(path, env={})
    assert config.unix_socket == "/run/stalwart/daemon.sock"
    assert config.data_dir == "/var/lib/stalwart"
    assert config.metrics_port == 9400


def test_example_config_names_every_key_and_sets_defaults_but_two_deployment_choices() -> None:
    text = EXAMPLE_TOML.read_text()
    set_here: dict[str, object] = {}
    for top, value in tomllib.loads(text).items():
        if isinstance(value, dict):
            set_here.update({f"{top}.{key}": inner for key, inner in value.items()})
        else:
            set_here[top] = value
    named, section = set(set_here), ""
    for line in text.splitlines():
        if m := re.fullmatch(r"\[(\w+)\]", line):
            section = m[1]
        elif m := re.match(r"#\s*([a-z_]\w*) = ", line):
            named.add(f"{section}.{m[1]}" if section else m[1])
    schema = {f"{s}.{k}" if s else k for s, keys in SCHEMA.items() for k in keys}
    assert named == schema
    differ = {k for k, v in set_here.items() if v != default(k)}
    # Under systemd the socket lives in RuntimeDirectory, and journald wants JSON always.
    assert differ == {"unix_socket", "log_format"}


def test_daemonset_memory_limit_covers_the_slots_and_the_ram_tier(tmp_path: Path) -> None:
    snapshot = configmap_config(tmp_path).snapshot
    (daemon,) = find("DaemonSet", "stalwart")["spec"]["template"]["spec"]["containers"]
    limit = daemon["resources"]["limits"]["memory"]
    assert limit.endswith("Gi")
    headroom = int(limit[:-2]) * (1 << 30) - snapshot.slot_bytes - snapshot.ram_tier_bytes
    assert headroom >= 512 << 20, f"{limit} leaves {headroom} bytes for the daemon itself"


def test_launchers_use_the_socket_their_deployed_daemon_serves(tmp_path: Path) -> None:
    sbatch = (ROOT / "deploy" / "slurm" / "train.sbatch").read_text()
    (slurm_default,) = re.findall(r'"\$\{STALWART_UNIX_SOCKET:=([^}]+)\}"', sbatch)
    assert slurm_default == load_config(EXAMPLE_TOML, env={}).unix_socket
    (train,) = find("Job", "classifier-train")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in train["env"]}
    assert env["STALWART_UNIX_SOCKET"] == configmap_config(tmp_path).unix_socket


def test_kubernetes_manifests_pass_strict_validation() -> None:
    result = run(tool("kubernetes-validate"), "--strict", "--quiet", *map(str, K8S))
    assert result.returncode == 0, result.stdout + result.stderr


def test_daemonset_is_locked_down_and_probed_over_grpc_health() -> None:
    ds = find("DaemonSet", "stalwart")
    pod = ds["spec"]["template"]["spec"]
    assert pod.get("hostNetwork") is False
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    (daemon,) = pod["containers"]
    sc = daemon["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert not sc["allowPrivilegeEscalation"]
    env = {e["name"]: e.get("value") for e in daemon["env"]}
    assert env["STALWART_LISTEN"] == "$(POD_IP):7070"  # probes and peers reach the pod IP
    for probe in ("livenessProbe", "readinessProbe"):
        assert daemon[probe]["grpc"]["port"] == 7070
    assert daemon["resources"]["limits"]["memory"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in daemon["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert volumes[mounts["/run/stalwart"]]["hostPath"]["path"] == "/run/stalwart"
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9400"


def test_peer_discovery_is_headless_and_read_only() -> None:
    service = find("Service", "stalwart-peers")
    assert service["spec"]["clusterIP"] == "None"
    role = find("Role", "stalwart-peer-discovery")
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert verbs == {"get", "list", "watch"}
    binding = find("RoleBinding", "stalwart-peer-discovery")
    assert binding["subjects"][0]["name"] == "stalwart"


def test_training_job_reaches_the_daemon_socket() -> None:
    pod = find("Job", "classifier-train")["spec"]["template"]["spec"]
    (train,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in train["env"]}
    socket_path = Path(env["STALWART_UNIX_SOCKET"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    mount = next(m for m in train["volumeMounts"] if m["mountPath"] == str(socket_path.parent))
    assert volumes[mount["name"]]["hostPath"]["path"] == "/run/stalwart"
    daemon_gid = find("DaemonSet", "stalwart")["spec"]["template"]["spec"]["containers"][0][
        "securityContext"]["runAsGroup"]
    assert daemon_gid in pod["securityContext"]["supplementalGroups"]


def test_alert_rules_pass_promtool_check() -> None:
    result = run(tool("promtool"), "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_pass_their_promtool_unit_tests() -> None:
    result = run(tool("promtool"), "test", "rules", "stalwart-rules.test.yml",
                 cwd=RULES.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = (RULES.parent / "stalwart-rules.test.yml").read_text()
    for alert in alert_exprs():
        assert f"alertname: {alert}" in tested, f"{alert} has no promtool unit test"


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    queries = panel_queries()
    rules = [{"record": f"panel:{q.dashboard}_{i}_{q.ref_id}", "expr": concrete(q.expr)}
             for i, q in enumerate(queries)]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    result = run(tool("promtool"), "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboards_and_alerts_use_only_exported_series() -> None:
    exported = exported_series_names()
    for q in panel_queries():
        names = metric_names(q.expr)
        assert names, f"{q.dashboard} / {q.panel}: no Stalwart series in {q.expr}"
        assert names <= exported, f"{q.dashboard} / {q.panel}: unknown {names - exported}"
    for alert, expr in alert_exprs().items():
        assert metric_names(expr) <= exported, f"{alert}: unknown {metric_names(expr) - exported}"


def test_committed_dashboards_match_their_generator() -> None:
    result = run(sys.executable, str(ROOT / "scripts" / "build_dashboards.py"), "--check")
    assert result.returncode == 0, result.stderr


def test_system_deps_script_installs_the_tools_used_here() -> None:
    script = (ROOT / "scripts" / "install-system-deps.sh").read_text()
    for command, package in (("promtool", "prometheus"), ("systemd-analyze", "systemd"),
                             ("shellcheck", "shellcheck")):
        assert f"command -v {command}" in script and f"need+=({package})" in script


def test_dashboards_have_a_datasource_variable_and_a_tidy_grid() -> None:
    for name in DASHBOARDS:
        model = json.loads((DASHBOARD_DIR / f"{name}.json").read_text())
        assert model["schemaVersion"] >= 36
        variables = {v["name"]: v for v in model["templating"]["list"]}
        assert variables["datasource"]["query"] == "prometheus"
        ids = [p["id"] for p in model["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        taken: set[tuple[int, int]] = set()
        for panel in model["panels"]:
            g = panel["gridPos"]
            assert g["x"] + g["w"] <= 24, f"{name} / {panel['title']} is wider than the grid"
            cells = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                     for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & taken, f"{name} / {panel['title']} overlaps another panel"
            taken |= cells


def test_operations_guide_documents_every_series() -> None:
    guide = (ROOT / "docs" / "operations.md").read_text()
    exported = {n for n in exported_series_names()
                if n.startswith("stalwart_") and not n.endswith(("_created", "_bucket", "_count",
                                                                  "_sum"))}
    undocumented = {n for n in exported if f"`{n}`" not in guide}
    assert not undocumented, f"add to the metrics catalogue in docs/operations.md: {undocumented}"


def test_metrics_catalogue_lists_exactly_the_series_of_metrics_py_with_their_types() -> None:
    guide = (ROOT / "docs" / "operations.md").read_text()
    section = guide.split("## Metrics catalogue", 1)[1].split("\n## ", 1)[0]
    documented = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`stalwart_"):
            documented[cells[0].strip("`")] = cells[1]
    suffix = {"counter": "_total", "info": "_info"}
    exported = {f.name + suffix.get(f.type, ""): f.type
                for f in Metrics().registry.collect() if f.name.startswith("stalwart_")}
    assert documented == exported


def test_grafana_provisioning_points_at_the_dashboards() -> None:
    provisioning = ROOT / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "stalwart.yaml").read_text())[
        "datasources"]
    assert source["type"] == "prometheus"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "stalwart.yaml").read_text())[
        "providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


LAUNCH_SCRIPTS = [ROOT / "deploy" / "slurm" / "train.sbatch",
                  ROOT / "deploy" / "ssh" / "run-job.sh"]


@pytest.mark.parametrize("script", LAUNCH_SCRIPTS, ids=lambda p: p.name)
def test_launch_examples_pass_shellcheck_and_start_stalwart_run_per_host(script: Path) -> None:
    result = run(tool("shellcheck"), str(script))
    assert result.returncode == 0, result.stdout + result.stderr
    assert run("bash", "-n", str(script)).returncode == 0
    text = script.read_text()
    assert "stalwart run --nnodes" in text and "--standby" in text
    assert "MASTER_ADDR" not in text.replace("no MASTER_ADDR", "").replace(
        "not through a fixed MASTER_ADDR", "")


def test_slurm_keeps_the_other_tasks_when_one_host_is_lost() -> None:
    assert "--kill-on-bad-exit=0" in (ROOT / "deploy" / "slurm" / "train.sbatch").read_text()


def test_the_kubernetes_job_is_indexed_one_pod_per_node_and_runs_a_protected_example() -> None:
    job = find("Job", "classifier-train")["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"]
    pod = job["template"]["spec"]
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    args = pod["containers"][0]["args"]
    assert args[0] == "run" and args[args.index("--nnodes") + 1] == str(job["completions"])
    script = next(a for a in args if a.endswith(".py"))
    assert (ROOT / "examples" / Path(script).relative_to("/opt/stalwart/examples")).exists()
