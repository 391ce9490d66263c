"""``python -m offloadlab`` runs the ``offloadlab`` command."""

import sys

from .cli import main

sys.exit(main())
