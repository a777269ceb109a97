"""``python -m feedline``: the same as the ``feedline`` command."""

import sys

from feedline.cli import main

sys.exit(main())
