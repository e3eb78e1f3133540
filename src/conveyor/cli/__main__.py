"""``python -m conveyor.cli``: the ``conveyor`` command without its console script."""

from conveyor.cli.main import command

__all__: list[str] = []

command()
