"""``python recipes/reproduce ...``: the reproduction harness's command line (:mod:`reproduce.cli`)."""

import sys
from pathlib import Path

# recipes/ on the path (the package `reproduce` and the recipes it runs and measures: cifar, wmt14, common),
# in place of this folder, whose modules are only meant to be imported as parts of the package
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from reproduce.cli import main  # noqa: E402

sys.exit(main())
