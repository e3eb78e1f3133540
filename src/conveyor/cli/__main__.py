"""``python -m conveyor.cli``: the ``conveyor`` command without its console script."""

import sys

from conveyor.cli.main import main

__all__: list[str] = []

sys.exit(main())
