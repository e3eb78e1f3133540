"""One rank of ``conveyor generate``: ``python -m conveyor.cli.generate_rank JSON``, which
torchrun starts. A module of its own that nothing imports: ``conveyor.cli`` imports
``conveyor.cli.generate``, which ``-m`` would then run a second time, with a warning."""

from conveyor.cli.generate import worker
from conveyor.runtime.peers import leave

__all__: list[str] = []

if __name__ == "__main__":
    leave(worker())  # See Note [threads at exit]
