"""How much of a pipeline schedule is idle, computed from the schedule itself.

A schedule is, per stage, the order of its actions: F (forward of a micro-batch), B (its full
backward), or I and W (the input and weight passes of a split backward). Given what each kind
costs, every stage runs its actions in order, each as soon as what it waits for is done:

* F of micro-batch m on stage s waits for F of m on stage s - 1;
* B or I of m on stage s waits for the B or I of m on stage s + 1 (the last stage: for its own F);
* W of m waits for the I of m on the same stage.

Communication is free here. The idle fraction is 1 - (time busy) / (stages x makespan): for 1F1B
with B = 2F it is the textbook (S - 1) / (M + S - 1) (tested). As torch runs it, the first stage of
a split schedule does nothing in its I slots and its whole backward in its W slots (its input
needs no gradient); the simulation does the same.

The orders are torch's: 1F1B as ``Schedule1F1B`` steps (warm-up of S - s forwards, then one
backward and one forward in turn), and 2BP as ``ScheduleInterleavedZeroBubble`` with one stage per
process computes its ``pipeline_order`` (read from a stand-in stage: no process group needed).
"""

from __future__ import annotations

from dataclasses import dataclass

Action = tuple[str, int]  # (kind "F" | "B" | "I" | "W", micro-batch)


def one_f_one_b_order(stages: int, microbatches: int) -> list[list[Action]]:
    """Each stage's actions as torch's ``Schedule1F1B`` runs them."""
    orders = []
    for s in range(stages):
        warmup = min(microbatches, stages - s)
        actions: list[Action] = [("F", m) for m in range(warmup)]
        forward, backward = warmup, 0
        while backward < microbatches:
            actions.append(("B", backward))
            backward += 1
            if forward < microbatches:
                actions.append(("F", forward))
                forward += 1
        orders.append(actions)
    return orders


def zero_bubble_order(stages: int, microbatches: int) -> list[list[Action]]:
    """Each stage's actions as torch's ``ScheduleInterleavedZeroBubble`` (one stage per process)
    orders them; its idle slots (None) are dropped: waiting is what the simulation computes."""
    import torch
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble, _PipelineStageBase

    class _StandIn(_PipelineStageBase):
        """Only what the schedule's constructor reads of a stage."""

        _create_grad_recv_info = _prepare_backward_infra = _prepare_forward_infra = None

        def __init__(self, index: int, n: int):  # (no process group: the base constructor is skipped)
            self.stage_index, self.num_stages, self.group_size, self.group_rank = index, n, n, index
            self.submod, self.has_backward, self.dw_builder = torch.nn.Linear(1, 1), True, None

        @property
        def is_first(self):
            return self.stage_index == 0

        @property
        def is_last(self):
            return self.stage_index == self.num_stages - 1

    schedule = ScheduleInterleavedZeroBubble([_StandIn(0, stages)], microbatches, loss_fn=lambda out, target: out)
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}
    return [[(kinds[a.computation_type.name], a.microbatch_index) for a in schedule.pipeline_order[s] if a is not None]
            for s in range(stages)]


@dataclass(frozen=True)
class Costs:
    """The time of each kind of action (any unit)."""

    F: float = 1.0
    B: float = 2.0
    I: float = 1.0  # noqa: E741 (the zero-bubble paper's name)
    W: float = 1.0


@dataclass(frozen=True)
class Timeline:
    makespan: float
    busy: float  # summed over stages
    stages: int

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy / (self.stages * self.makespan)


def simulate(orders: list[list[Action]], costs: Costs) -> Timeline:
    """Run every stage's actions in order, each when its inputs are ready (see the module)."""
    stages = len(orders)
    done: dict[tuple[int, str, int], float] = {}  # (stage, kind, micro-batch) -> end time
    position = [0] * stages
    clock = [0.0] * stages
    busy = 0.0
    progressed = True
    while progressed:
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                kind, m = orders[s][position[s]]
                if kind == "F":
                    waits = [(s - 1, "F", m)] if s > 0 else []
                elif kind in "BI":
                    waits = [(s, "F", m)] + ([(s + 1, "B", m), (s + 1, "I", m)] if s < stages - 1 else [])
                else:  # W
                    waits = [(s, "I", m)]
                if kind in "BI" and s < stages - 1:  # the next stage's backward of m, full or input pass
                    upstream = [done[w] for w in waits[1:] if w in done]
                    if not upstream or (s, "F", m) not in done:
                        break
                    ready = max(done[(s, "F", m)], *upstream)
                elif all(w in done for w in waits):
                    ready = max([done[w] for w in waits], default=0.0)
                else:
                    break
                cost = getattr(costs, kind)
                if s == 0 and kind in "IW":  # (torch: the first stage's backward runs whole in its W slot)
                    cost = 0.0 if kind == "I" else costs.B
                start = max(clock[s], ready)
                clock[s] = start + cost
                busy += cost
                done[(s, kind, m)] = clock[s]
                position[s] += 1
                progressed = True
    if any(p < len(o) for p, o in zip(position, orders)):
        raise ValueError("the schedule deadlocks: an action waits for one that never runs")
    return Timeline(max(clock), busy, stages)


def idle_fraction(schedule: str, stages: int, microbatches: int, costs: Costs) -> float:
    """The idle fraction of ``schedule`` ("1f1b" or "2bp") for ``stages`` and ``microbatches``."""
    if schedule == "1f1b":
        orders = one_f_one_b_order(stages, microbatches)
    elif schedule == "2bp":
        orders = zero_bubble_order(stages, microbatches)
    else:
        raise ValueError(f"schedule must be 1f1b or 2bp, got {schedule!r}")
    return simulate(orders, costs).idle_fraction
