"""``python -m linearize.cli``: the ``linearize`` console script."""

import sys

from . import main

sys.exit(main())
