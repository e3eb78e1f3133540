"""Where a schedule wants its stages: stages per rank and their placement, in one rule.

stage_placement("zb-v", num_ranks=4)          # [0, 1, 2, 3, 3, 2, 1, 0]
stage_placement("1f1b", 2, num_stages=2)      # [0, 1]
"""

from __future__ import annotations

from conveyor.graph import PlacementStyle, place
from conveyor.program import Schedule
from conveyor.schedule.registry import ScheduleSpec, spec_of

__all__ = ["stage_placement"]


def stage_placement(
    schedule: str | Schedule,
    num_ranks: int,
    *,
    num_stages: int | None = None,
    virtual_stages: int | None = None,
    style: PlacementStyle | None = None,
) -> list[int]:
    """Rank of each stage when ``schedule`` runs on ``num_ranks`` ranks.

    ``num_stages`` is what the split fixes (balance, split points), else ``virtual_stages``
    per rank (default: the schedule's); stages share ranks by ``style`` (default: the
    schedule's). For a schedule of one stage per rank, a stage count that is not a multiple
    of the ranks keeps stage i on rank i, so the split can say that the counts do not match.

    Raises:
        ValueError: ``virtual_stages`` and ``num_stages`` disagree, a count is below 1, or
            the stage count does not fit a schedule of several stages per rank.
    """
    wanted = spec_of(schedule)
    per_rank = virtual_stages or wanted.virtual_stages
    if num_ranks < 1 or per_rank < 1:
        raise ValueError(f"ranks and stages per rank must be >= 1, got {num_ranks} and {per_rank}")
    if virtual_stages is not None and num_stages not in (None, per_rank * num_ranks):
        raise ValueError(
            f"virtual_stages={per_rank} on {num_ranks} ranks makes "
            f"{per_rank * num_ranks} stages, but the split has {num_stages}; "
            "drop virtual_stages or give a split with that many stages"
        )
    _check_stage_count(
        schedule, wanted, num_stages or per_rank * num_ranks, num_ranks, virtual_stages
    )
    num_stages = num_stages or per_rank * num_ranks
    if num_stages % num_ranks:
        return list(range(num_stages))
    return place(num_stages, num_ranks, style or wanted.placement)


def _check_stage_count(
    schedule: str | Schedule,
    wanted: ScheduleSpec,
    num_stages: int,
    num_ranks: int,
    virtual_stages: int | None,
) -> None:
    """Refuse a stage count (the split's, or ``virtual_stages`` per rank) that a schedule of
    several stages per rank cannot place."""
    if wanted.runs != "chain":
        return
    needed = wanted.virtual_stages * num_ranks
    if wanted.exact and num_stages != needed:
        wants = f"{wanted.virtual_stages} stages on each rank: {needed} on {num_ranks} ranks"
    elif num_stages % num_ranks:
        wants = f"the same number of stages on each of the {num_ranks} ranks"
    else:
        return
    if virtual_stages is not None:
        raise ValueError(
            f"schedule {schedule!r} needs {wants}, but virtual_stages={virtual_stages} makes "
            f"{num_stages}; pass virtual_stages={wanted.virtual_stages}, or leave it out"
        )
    raise ValueError(
        f"schedule {schedule!r} needs {wants}, but the split makes {num_stages}; give a "
        f"balance of {needed} entries (or {needed - 1} split points)"
    )
