"""``python -m rome.bench``: the main RoME benchmark (see ``--help``)."""

import sys

from .cli import main

sys.exit(main())
