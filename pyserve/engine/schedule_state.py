"""`ScheduleState`: the requests the scheduler holds, by where they are. Loop thread only.

The scheduler's collaborators move requests between these sets: the batch planner admits
from `waiting` (engine/batch_planner.py), the step pipeline makes the admitted `running` and
releases the finished (engine/step_pipeline.py), the retractor sends requests back to
`waiting` (engine/retraction.py). Each holds this one object, so none reaches into another's
attributes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pyserve.engine.schedule_batch import Req
from pyserve.metrics import RequestMetrics


@dataclass(slots=True, eq=False)
class ScheduleState:
    """waiting: not admitted (nothing allocated), in admission order once the planner ordered
    it; a retracted request waits again at its head. running: admitted, prompt prefilled (or
    its last chunk planned): what a decode step takes; finished ones stay until released.
    chunked_req: admitted, its prompt partly prefilled in chunks (in neither list). reqs:
    every request not yet released (the grammar queue's too), by rid. metrics: where each
    request's end is recorded as it leaves (None: not recorded)."""

    waiting: deque[Req] = field(default_factory=deque)
    running: list[Req] = field(default_factory=list)
    chunked_req: Req | None = None
    reqs: dict[str, Req] = field(default_factory=dict)
    metrics: RequestMetrics | None = None

    def forget(self, req: Req) -> None:
        """Drop `req` from `reqs` (it is released, or ended holding nothing)."""
        if self.reqs.get(req.rid) is req:  # the rid may already name a newer request
            del self.reqs[req.rid]
            if self.metrics is not None:
                self.metrics.request_left(req)
