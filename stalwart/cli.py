"""The `stalwart` command: a thin dispatcher to subcommands.

Each subcommand lives in its own module and is imported only when chosen, so
`stalwart daemon` never pays for importing torch. A subcommand module exposes
``configure(parser)`` to add its arguments and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from stalwart import __version__

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "daemon": ("stalwart.daemon.cli", "run the per-node daemon"),
    "status": ("stalwart.daemon.status_cli", "show daemons, ranks, plan and storage"),
    "demo": ("stalwart.client.demo", "run a local cluster: train, inject failures, recover"),
    "run": ("stalwart.client.run_cli", "start this host's ranks and spares of a protected job "
            "(torchrun-compatible)"),
    "chaos": ("stalwart.client.chaos", "run a seeded campaign of fault schedules, check each"),
    "train": ("stalwart.client.train_cli", "train the GPT with DP x PP x TP as local processes"),
    "plan": ("stalwart.core.offline.plan_cli",
             "partition layers into stages, advise a parallel strategy"),
    "bench": ("stalwart.bench.cli", "run a benchmark and write its figures as JSON"),
    "export": ("stalwart.client.interop", "write a committed step as a PyTorch checkpoint"),
    "import": ("stalwart.client.interop", "read a PyTorch checkpoint into the snapshot store"),
}


def _top_level_help() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = [f"stalwart {__version__}", "", "usage: stalwart COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `stalwart COMMAND --help` for the options of one command; "
              "`--debug` shows tracebacks."]
    return "\n".join(lines)


def debugging() -> bool:
    """Whether `--debug` (or STALWART_DEBUG=1) asked for tracebacks and gRPC's log lines."""
    return os.environ.get("STALWART_DEBUG", "") not in ("", "0")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `stalwart --debug COMMAND ...` (or STALWART_DEBUG=1): tracebacks and gRPC's own
    # log lines. Only before the command: what follows may be a script's own arguments.
    debug = debugging()
    while argv and argv[0] == "--debug":
        debug, argv = True, argv[1:]
    if debug:
        os.environ["STALWART_DEBUG"] = "1"  # for subcommands and the processes they start
    else:
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is imported
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_level_help())
        return 0
    if argv[0] == "--version":
        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"stalwart: unknown command {name!r}\n\n{_top_level_help()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"stalwart {name}", description=COMMANDS[name][1])
    module.configure(parser, name) if _takes_name(module) else module.configure(parser)
    args = parser.parse_args(rest)
    if debug:
        return int(module.run(args) or 0)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"stalwart {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # `| head` is done
        return 0
    except Exception as e:  # a bug or an unforeseen failure: one line, details on demand
        what = " ".join(str(e).split())  # one line, whatever the message holds
        print(f"stalwart {name}: {type(e).__name__}: {what} (run `stalwart --debug {name} ...` "
              "for the traceback)", file=sys.stderr)
        return 1


def _takes_name(module: object) -> bool:
    """`export` and `import` share a module; it is told which one was asked."""
    return getattr(module, "CONFIGURE_TAKES_NAME", False)


if __name__ == "__main__":
    raise SystemExit(main())
