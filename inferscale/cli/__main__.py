"""``python -m inferscale.cli``."""

import sys

from inferscale.cli import main

sys.exit(main())
