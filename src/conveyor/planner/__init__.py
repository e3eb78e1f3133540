"""Profile and plan: measure a model, predict any configuration, pick the best that fits.

    report = plan(load_workload("gpt"), num_ranks=2, memory_budget=2**30, batch_size=32)
    print(report.table()); report.write("plan.json")   # Pipeline(model, plan="plan.json")

Modules: ``profile`` (per-layer time and memory), ``calibrate`` (runtime overheads, the link
between ranks, and fitting a profile to a traced run), ``local`` (all of it on two ranks
started here, within a deadline), ``cost`` (a profile as the simulator's cost model),
``partition`` (optimal splits of a profiled model), ``search`` (the planner) and
``candidates`` (its splits, recomputation and simulations per schedule), ``budget``
(one time budget for a planning call, measuring included), ``report`` (its plans and plan
file), ``layouts`` (dp x pp layouts of a world of ranks, each pipeline planned, gradient
reductions simulated), ``workloads`` (models known by name), ``input`` (whether a plan
waits for its loader) and ``parallelism`` (pipeline, tensor and context parallelism for one
long request, on decode's costs: conveyor.inference.cost).
"""

from conveyor.planner.budget import DEFAULT_TIME_BUDGET_S, Budget
from conveyor.planner.calibrate import (
    fit,
    fit_to_run,
    measure_allreduce,
    measure_between_work,
    measure_link,
    measure_overheads,
    profile_together,
)
from conveyor.planner.cost import (
    Prediction,
    ProfileCost,
    Replicas,
    layout,
    predict,
    split_units,
)
from conveyor.planner.input import input_bound, loader_seconds
from conveyor.planner.layouts import MeshPlan, MeshReport, plan_mesh
from conveyor.planner.local import (
    measure_local,
    measure_reduce_link,
    measured_profile,
    profile_local,
    with_reduce_link,
)
from conveyor.planner.profile import (
    Link,
    Overheads,
    Profile,
    Unit,
    UnitStats,
    Workload,
    profile_model,
    scaled,
    trace_units,
)
from conveyor.planner.report import Coverage, Objective, Plan, PlanReport, stage_graph_for
from conveyor.planner.search import plan
from conveyor.planner.workloads import EXAMPLES, example, load_workload

__all__ = [
    "DEFAULT_TIME_BUDGET_S",
    "EXAMPLES",
    "Budget",
    "Coverage",
    "Link",
    "MeshPlan",
    "MeshReport",
    "Objective",
    "Overheads",
    "Plan",
    "PlanReport",
    "Prediction",
    "Profile",
    "ProfileCost",
    "Replicas",
    "Unit",
    "UnitStats",
    "Workload",
    "example",
    "fit",
    "fit_to_run",
    "input_bound",
    "layout",
    "load_workload",
    "loader_seconds",
    "measure_allreduce",
    "measure_between_work",
    "measure_link",
    "measure_local",
    "measure_overheads",
    "measure_reduce_link",
    "measured_profile",
    "plan",
    "plan_mesh",
    "predict",
    "profile_local",
    "profile_model",
    "profile_together",
    "scaled",
    "split_units",
    "stage_graph_for",
    "trace_units",
    "with_reduce_link",
]
