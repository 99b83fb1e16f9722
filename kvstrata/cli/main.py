"""The ``kvstrata`` command: a tiered KV-cache store with a DFlash speculative runtime.

Examples:
  kvstrata demo                        multi-turn agent workload, paged vs arena drafter
  kvstrata bench acceptance            acceptance length cold vs warm per tier and codec
  kvstrata inspect /path/to/tier       what a disk tier holds (safe while an engine writes)
  kvstrata stress --seconds 30         random page traffic through the tiers, every read checked
  kvstrata serve kvstrata-tiny-py --drafter kvstrata-tiny-py --port 8000
                                       OpenAI-compatible server (completions, chat, /metrics)

Exit codes: 0 success, 1 a check failed (wrong or corrupt pages), 2 usage error.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand -> module (imported only when that subcommand runs, so `kvstrata inspect` does not
#: pay for torch-heavy imports of the runtime). Each module has ``HELP``, ``add_arguments``, ``run``.
SUBCOMMANDS = {
    "demo": "kvstrata.cli.demo",
    "bench": "kvstrata.cli.bench",
    "inspect": "kvstrata.cli.inspect",
    "stress": "kvstrata.cli.stress",
    "serve": "kvstrata.cli.serve",
}

#: Exit status of a usage error (bad flags or values), as argparse uses.
EXIT_USAGE = 2


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the modules' docstrings as written and shows every option's default."""


def _version() -> str:
    from kvstrata import __version__
    return f"kvstrata {__version__}"


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="kvstrata", description=doc[0], epilog=doc[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, modname in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name == modname:
                continue  # subcommand not built yet
            raise
        p = sub.add_parser(name, help=mod.HELP, description=mod.__doc__,
                           formatter_class=HelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ValueError as e:
        # Bad values the parser could not see (a codec name, a budget that does not fit): one
        # line, usage status, no traceback.
        print(f"kvstrata {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"kvstrata {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
