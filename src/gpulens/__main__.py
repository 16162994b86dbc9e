"""``python -m gpulens``: the ``gpulens`` command line (as ``python -m gpulens.cli``)."""

import sys

from gpulens.cli import main

sys.exit(main())
