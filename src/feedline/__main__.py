"""``python -m feedline``: the same as the ``feedline`` command."""

import sys

from feedline.cli import console

sys.exit(console())
