"""The ``zarrlake`` command line as a Python file, for ``spark-submit`` (which runs ``.py`` files,
not console scripts): ``spark-submit ... zarrlake_main.py gc URL --engine spark --json``.

The operator's ``engine: spark`` jobs run it from the image of ``examples/spark/Dockerfile``
(``/opt/zarrlake/examples/spark/zarrlake_main.py``). Kept apart from the package on purpose: run as
a script, a file's own directory goes first on ``sys.path``, and the package's directory would
shadow standard modules (``types``) with its own.
"""

import sys

from zarrlake.cli import main

if __name__ == "__main__":
    sys.exit(main())
