"""``python -m secure_vfl`` runs the command line."""

import sys

from secure_vfl.cli import main

sys.exit(main())
