"""``python -m gpulens.cli``."""

import sys

from gpulens.cli import main

sys.exit(main())
