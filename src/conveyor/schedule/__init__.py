"""Pipeline schedules: pure functions StageGraph x micro-batches -> Program.

    program = build_program("1f1b", chain(4), num_microbatches=8)   # validated
    program = one_f_one_b(chain(2), 2); str(program)                 # "0F0 0SF0>1 ..."

Modules: ``chain`` (GPipe, 1F1B, forward-only), ``interleaved``, ``zero_bubble`` (ZB-H1, ZB-V),
``dualpipe`` (DualPipeV), ``dag`` (list schedules over any DAG of stages), ``validate``,
``registry`` (one spec per shipped schedule: builder, layout, what it runs), ``layout`` (the
rank of every stage) and ``build`` (schedules by name, from text). The actions and Programs
they produce are ``conveyor.program``'s.
"""

from conveyor.program import Action, Kind, Program, Schedule, ScheduleMismatch
from conveyor.schedule.build import build_program, from_text, schedule_name
from conveyor.schedule.chain import forward_only, gpipe, one_f_one_b
from conveyor.schedule.dag import graph_1f1b, graph_gpipe, list_schedule
from conveyor.schedule.dualpipe import dualpipe_v
from conveyor.schedule.interleaved import interleaved_1f1b
from conveyor.schedule.layout import stage_placement
from conveyor.schedule.registry import SCHEDULES, ScheduleSpec, schedules_for, spec_of
from conveyor.schedule.validate import ProgramError, validate
from conveyor.schedule.zero_bubble import zb_h1, zb_v

__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "Program",
    "ProgramError",
    "Schedule",
    "ScheduleMismatch",
    "ScheduleSpec",
    "build_program",
    "dualpipe_v",
    "forward_only",
    "from_text",
    "gpipe",
    "graph_1f1b",
    "graph_gpipe",
    "interleaved_1f1b",
    "list_schedule",
    "one_f_one_b",
    "schedule_name",
    "schedules_for",
    "spec_of",
    "stage_placement",
    "validate",
    "zb_h1",
    "zb_v",
]
