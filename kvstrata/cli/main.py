"""The ``kvstrata`` command. Each subcommand lives in its own module with ``HELP``, ``add_arguments`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand -> module (imported only when that subcommand runs, so `kvstrata inspect` does not
#: pay for torch-heavy imports of the runtime).
SUBCOMMANDS = {
    "demo": "kvstrata.cli.demo",
    "bench": "kvstrata.cli.bench",
    "inspect": "kvstrata.cli.inspect",
    "stress": "kvstrata.cli.stress",
    "serve": "kvstrata.cli.serve",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstrata", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, modname in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name == modname:
                continue  # subcommand not built yet
            raise
        p = sub.add_parser(name, help=mod.HELP, description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
