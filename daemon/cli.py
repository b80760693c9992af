"""`stalwart daemon` and `stalwartd`: read the configuration and run the daemon.

Flags win over STALWART_* environment variables, which win over the TOML file.
A bad setting ends the process with exit code 2 and one line naming the key.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from stalwart.daemon.config import ConfigError, DaemonConfig, load_config

# flag -> configuration key
FLAGS = {
    "listen": ("HOST:PORT", "TCP endpoint for peers and operators (default 127.0.0.1:7070)"),
    "unix_socket": ("PATH", "Unix socket for local ranks (default <data-dir>/daemon.sock)"),
    "metrics_port": ("PORT", "port of the Prometheus /metrics endpoint, 0 = off (default 9400)"),
    "data_dir": ("DIR", "directory for the daemon's state (default /var/lib/stalwart)"),
    "node": ("NAME", "name of this node (default: the hostname)"),
    "peers": ("HOST:PORT,...", "peer daemons to gossip with"),
    "job_id": ("ID", "job this daemon serves (default 'default')"),
    "log_format": ("json|text", "log format (default: json unless stderr is a terminal)"),
    "log_level": ("LEVEL", "DEBUG, INFO, WARNING or ERROR (default INFO)"),
    "tls.cert": ("FILE", "PEM certificate of this daemon; turns on mutual TLS on --listen"),
    "tls.key": ("FILE", "PEM private key of --tls-cert"),
    "tls.ca": ("FILE", "PEM CA that signs every daemon and operator of the cluster"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    for key, (metavar, help_) in FLAGS.items():
        # Values stay strings here so the config module reports every bad value alike.
        flag = key.replace("_", "-").replace(".", "-")
        parser.add_argument(f"--{flag}", dest=key, metavar=metavar, help=help_)


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    return load_config(args.config, overrides={key: getattr(args, key) for key in FLAGS})


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as e:
        print(f"stalwart daemon: config error: {e}", file=sys.stderr)
        return 2
    from stalwart.daemon.logs import setup_logging
    from stalwart.daemon.server import serve

    setup_logging(config.log_format, config.log_level)
    return asyncio.run(serve(config))


def stalwartd_main(argv: list[str] | None = None) -> int:
    """Entry point of the `stalwartd` command (same options as `stalwart daemon`)."""
    parser = argparse.ArgumentParser(prog="stalwartd", description="run the per-node daemon")
    configure(parser)
    return run(parser.parse_args(argv))
