"""``python -m brigade`` runs the command line."""

import sys

from brigade.cli import main

sys.exit(main())
