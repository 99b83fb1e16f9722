"""Start ``kvstrata serve`` for the tests (with the engine shim while main lacks the engine core)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_shim  # noqa: E402

engine_shim.install()

from kvstrata.cli.main import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
