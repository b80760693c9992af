"""Daemon configuration: file < environment < flags, and one-line errors naming the key."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_daemon import daemon_env

from stalwart.daemon.config import DaemonConfig, load_config
from stalwart.daemon.config_schema import SCHEMA, ConfigError, daemon_socket, default


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stalwart.toml"
    path.write_text(text)
    return path


def test_defaults_follow_the_documented_contract() -> None:
    cfg = load_config(env={})
    assert cfg.node == socket.gethostname()
    assert (cfg.job_id, cfg.listen, cfg.metrics_port) == ("default", "127.0.0.1:7070", 9400)
    assert cfg.data_dir == "/var/lib/stalwart"
    assert cfg.unix_socket == "/var/lib/stalwart/daemon.sock"
    assert (cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s) == (1.0, 5.0)
    assert (cfg.erasure.k, cfg.erasure.m, cfg.erasure.parity_to) == (2, 1, "peers")
    assert (cfg.snapshot.base_every, cfg.snapshot.retain) == (10, 5)
    assert cfg.snapshot.chunk_bytes == 4194304
    assert (cfg.snapshot.slot_bytes, cfg.snapshot.ram_tier_bytes) == (8 << 30, 1 << 30)
    assert cfg.peers == () and cfg.token == "" and cfg.log_format == ""


def test_an_empty_configuration_is_the_dataclass_defaults() -> None:
    assert load_config(env={}) == DaemonConfig()
    assert DaemonConfig().snapshot.slot_bytes == default("snapshot.slot_bytes")


def test_built_directly_the_socket_follows_data_dir_as_when_loaded() -> None:
    loaded = load_config(env={"STALWART_DATA_DIR": "/d"})
    assert DaemonConfig(data_dir="/d").unix_socket == loaded.unix_socket == "/d/daemon.sock"


@pytest.mark.parametrize("env", [{}, {"STALWART_DATA_DIR": "/d"},
                                 {"STALWART_DATA_DIR": "/d", "STALWART_UNIX_SOCKET": "/s.sock"}])
def test_clients_find_the_socket_where_a_daemon_with_their_environment_serves(
        env: dict[str, str]) -> None:
    assert daemon_socket(env) == load_config(env=env).unix_socket


def test_every_key_has_a_meaning_for_the_reference_table() -> None:
    undocumented = [f"{section}.{key}" for section, keys in SCHEMA.items()
                    for key, spec in keys.items() if not spec.doc]
    assert undocumented == []


def test_flags_win_over_environment_which_wins_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, 'listen = "0.0.0.0:1"\nmetrics_port = 1\nnode = "file"\n'
                           '[erasure]\nk = 3\nm = 2\n')
    env = {"STALWART_LISTEN": "127.0.0.1:2", "STALWART_NODE": "env",
           "STALWART_ERASURE__K": "5"}
    cfg = load_config(path, env=env, overrides={"listen": "127.0.0.1:3", "node": None})
    assert cfg.listen == "127.0.0.1:3"  # flag
    assert cfg.node == "env"  # an unset flag (None) leaves the environment's value
    assert (cfg.erasure.k, cfg.erasure.m) == (5, 2)  # env section key, file
    assert cfg.metrics_port == 1


def test_environment_lists_and_sections_are_parsed(tmp_path: Path) -> None:
    env = {"STALWART_PEERS": "a:7070, b:7071", "STALWART_SNAPSHOT__SLOT_BYTES": "1_000",
           "STALWART_DATA_DIR": str(tmp_path), "STALWART_LABELS__RACK": "r1",
           "STALWART_SOCKET_OF_SOMETHING_ELSE": "ignored"}
    cfg = load_config(env=env)
    assert cfg.peers == ("a:7070", "b:7071")
    assert cfg.snapshot.slot_bytes == 1000
    assert cfg.labels.rack == "r1"
    assert cfg.unix_socket == str(tmp_path / "daemon.sock")


@pytest.mark.parametrize(("text", "expected"), [
    ('lisen = "127.0.0.1:1"\n', "lisen: unknown key"),
    ('[erasure]\nkk = 1\n', "erasure.kk: unknown key"),
    ('[erasures]\nk = 1\n', "erasures: unknown section"),
    ('[erasure]\nk = "two"\n', "erasure.k: must be an integer, got 'two'"),
    ('[erasure]\nk = 0\n', "erasure.k: must be >= 1"),
    ('[erasure]\nparity_to = "tape"\n', "erasure.parity_to: must be one of peers, s3, both"),
    ('[snapshot]\nslot_bytes = 0\n', "snapshot.slot_bytes: must be >= 1"),
    ('log_format = "xml"\n', "log_format: must be one of json, text"),
    ('listen = "localhost"\n', "listen: must be HOST:PORT"),
    ('metrics_port = 70000\n', "metrics_port: must be a port number"),
    ('peers = ["a:1", "b"]\n', "peers: entry 'b' must be HOST:PORT"),
    ('peers = "a:1"\n', "peers: must be a list of strings"),
    ('heartbeat_timeout_s = 0.5\n', "heartbeat_timeout_s: must be greater than"),
    ('erasure = 3\n', "erasure: must be a table"),
    ('[tls]\ncert = "c.pem"\n', "tls.cert: tls.cert and tls.key must be given together"),
    ('unix_socket = "/tmp/' + "x" * 120 + '"\n', "unix_socket: is longer than"),
    ('listen = \n', "is not valid TOML"),
])
def test_bad_file_gives_one_line_error_naming_the_key(tmp_path: Path, text: str,
                                                       expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    message = str(err.value)
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize("source", ["file", "env"])
def test_the_old_ram_bytes_key_stops_the_daemon_naming_the_two_keys_it_became(
        tmp_path: Path, source: str) -> None:
    path = write(tmp_path, "[snapshot]\nram_bytes = 0\n") if source == "file" else None
    env = {"STALWART_SNAPSHOT__RAM_BYTES": "0"} if source == "env" else {}
    with pytest.raises(ConfigError) as err:
        load_config(path, env=env)
    message = str(err.value)
    assert message.startswith("snapshot.ram_bytes: ") and "\n" not in message
    assert "snapshot.slot_bytes" in message and "snapshot.ram_tier_bytes" in message


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"erasure\.k: .* \(from \$STALWART_ERASURE__K\)"):
        load_config(env={"STALWART_ERASURE__K": "many"})


def test_missing_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})


def test_daemon_with_bad_config_exits_2_with_one_line_naming_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, '[erasure]\nk = "two"\n')
    done = subprocess.run(
        [sys.executable, "-m", "stalwart.cli", "daemon", "--config", str(path),
         "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=30, env=daemon_env())
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "erasure.k" in lines[0] and "integer" in lines[0] and str(path) in lines[0]


def test_stalwartd_with_bad_flag_exits_2_naming_the_key(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from stalwart.daemon.cli import stalwartd_main as m; "
                               "raise SystemExit(m(['--metrics-port', 'lots']))"],
        capture_output=True, text=True, timeout=30, env=daemon_env())
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "stalwart daemon: config error: metrics_port: must be an integer, got 'lots' "
        "(from --metrics-port)")
