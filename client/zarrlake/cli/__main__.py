"""``python -m zarrlake.cli``: the command line (see :mod:`zarrlake.cli`)."""

import sys

from zarrlake.cli import main

sys.exit(main())
