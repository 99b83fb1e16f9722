"""``python -m kvstrata`` runs the ``kvstrata`` command."""

import sys

from kvstrata.cli.main import main

sys.exit(main())
