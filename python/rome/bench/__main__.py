"""``python -m rome.bench``: the main RoME benchmark (see ``--help``)."""

import sys

from .glibc_streaming import reexec_with_streaming_memmove

reexec_with_streaming_memmove()

from .cli import main  # noqa: E402

sys.exit(main())
