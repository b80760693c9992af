"""`stalwart daemon` and `stalwartd`: read the configuration and run the daemon.

Flags win over STALWART_* environment variables, which win over the TOML file.
A bad setting ends the process with exit code 2 and one line naming the key.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from stalwart.daemon.config import DaemonConfig, load_config
from stalwart.daemon.config_schema import SCHEMA, ConfigError, shown_default

# flag -> configuration key's metavar; the help and the default come from SCHEMA.
FLAGS = {
    "listen": "HOST:PORT", "unix_socket": "PATH", "metrics_port": "PORT", "data_dir": "DIR",
    "node": "NAME", "peers": "HOST:PORT,...", "job_id": "ID", "log_format": "json|text",
    "log_level": "LEVEL", "tls.cert": "FILE", "tls.key": "FILE", "tls.ca": "FILE",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    for key, metavar in FLAGS.items():
        section, _, name = key.rpartition(".")
        spec = SCHEMA[section][name]
        help_ = spec.doc + (f" (default: {shown_default(key)})" if spec.default or spec.shown
                            else "")
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
    """Entry point of the `stalwartd` command: `stalwart daemon` under another name (the
    same options, the same one-line errors and `--debug`)."""
    import sys

    from stalwart.cli import main

    return main(["daemon", *(sys.argv[1:] if argv is None else argv)])
