"""``python -m daca.cli COMMAND ...``: the same as the ``daca`` command."""

import sys

from daca.cli import main

sys.exit(main())
