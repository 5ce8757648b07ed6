"""The order in which a pipeline stage runs its micro-batches.

A schedule is, for each stage, a list of actions `("F", m)` (forward pass of
micro-batch m) and `("B", m)` (its backward pass). Stage s receives
micro-batch m's activations from stage s - 1 before its `("F", m)` and the
gradient from stage s + 1 before its `("B", m)`, so any order that every
stage follows ends, and the two schedules differ in how many activations a
stage holds at once:

- GPipe (Huang et al. 2019): every forward pass, then every backward pass.
  Stage s holds all M micro-batches' activations.
- 1F1B (PipeDream-flush, Narayanan et al. 2021): S - s - 1 forward passes to
  fill the pipe, then one forward and one backward in turn, then the
  remaining backward passes. Stage s holds at most S - s micro-batches.

Both take M + S - 1 forward slots and as many backward slots, of which
S - 1 are idle on every stage: the bubble fraction (S - 1) / (M + S - 1).
"""

SCHEDULES = ("gpipe", "1f1b")


def check(schedule):
    """The schedule's name in lower case, or a ValueError naming the known ones."""
    name = str(schedule).lower()
    if name not in SCHEDULES:
        raise ValueError(f"Unknown pipeline schedule {schedule!r}; use one of "
                         f"{', '.join(SCHEDULES)}.")
    return name


def actions(schedule, stage, stages, micro_batches):
    """Stage `stage`'s actions, in order, for `micro_batches` micro-batches.

    Args:
        schedule: "gpipe" or "1f1b" (any case).
        stage: the stage, from 0 to `stages - 1`.
        stages: how many stages the pipeline has.
        micro_batches: micro-batches per step, at least 1.

    Returns:
        A list of `("F", m)` (forward pass of micro-batch m) and `("B", m)`
            (its backward pass).

    Raises:
        ValueError: an unknown schedule, a stage outside the pipeline, or no
            micro-batch.

    Example:

        >>> actions("1f1b", 0, 2, 3)
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
        >>> actions("1f1b", 1, 2, 3)
        [('F', 0), ('B', 0), ('F', 1), ('B', 1), ('F', 2), ('B', 2)]
    """
    name = check(schedule)
    if not 0 <= stage < stages:
        raise ValueError(f"Stage {stage} is not one of the {stages} stages.")
    if micro_batches < 1:
        raise ValueError(f"A step needs at least one micro-batch; got {micro_batches}.")
    forward = [("F", m) for m in range(micro_batches)]
    if name == "gpipe":
        return forward + [("B", m) for m in reversed(range(micro_batches))]
    warm_up = min(stages - stage - 1, micro_batches)
    order = forward[:warm_up]
    for m in range(micro_batches - warm_up):
        order += [("F", warm_up + m), ("B", m)]
    return order + [("B", m) for m in range(micro_batches - warm_up, micro_batches)]


def peak_in_flight(order):
    """The most micro-batches whose activations a stage holds at once, for an
    `order` of actions such as `actions` returns.

    >>> peak_in_flight(actions("gpipe", 0, 2, 3)), peak_in_flight(actions("1f1b", 0, 2, 3))
    (3, 2)
    """
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def simulate(schedule, stages, micro_batches, forward_time=1.0, backward_time=2.0):
    """Runs the schedule on an ideal clock: returns (makespan, bubble fraction).

    Each action starts when its stage is free and its input has arrived
    (messages take no time). `forward_time` and `backward_time` are one
    micro-batch's pass on a stage, the same for all or a list with one per
    stage. The bubble is the share of the makespan a stage is idle, averaged
    over stages; with equal stages it is (S - 1) / (M + S - 1) for both
    schedules.
    """
    forward = _per_stage(forward_time, stages)
    backward = _per_stage(backward_time, stages)
    orders = [actions(schedule, s, stages, micro_batches) for s in range(stages)]
    done = {}  # (kind, stage, m) -> finish time
    clock = [0.0] * stages
    position = [0] * stages
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(stages):
            if position[s] == len(orders[s]):
                continue
            kind, m = orders[s][position[s]]
            if kind == "F":
                needed = ("F", s - 1, m) if s > 0 else None
                length = forward[s]
            else:
                needed = ("B", s + 1, m) if s < stages - 1 else ("F", s, m)
                length = backward[s]
            if needed is not None and needed not in done:
                continue
            start = max(clock[s], done.get(needed, 0.0))
            clock[s] = done[(kind, s, m)] = start + length
            position[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"The {schedule} schedule deadlocks with {stages} stages and "
                               f"{micro_batches} micro-batches.")
    makespan = max(clock)
    idle = [1.0 - micro_batches * (forward[s] + backward[s]) / makespan for s in range(stages)]
    return makespan, sum(idle) / stages


def _per_stage(times, stages):
    if isinstance(times, (int, float)):
        return [float(times)] * stages
    times = [float(t) for t in times]
    if len(times) != stages:
        raise ValueError(f"Give one time per stage ({stages}); got {len(times)}.")
    return times
