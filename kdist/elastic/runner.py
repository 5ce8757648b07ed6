"""`kdist.elastic.run`: call a training function again after ranks died."""

import functools
import logging
import os
import signal
import sys

from kdist.comm import ending, processes, recovery
from kdist.elastic.state import HostsUpdatedInterrupt, State

# Horovod's name for the error a lost rank causes.
HorovodInternalError = recovery.RanksLost
"""Horovod's name for `RanksLost`, the error a lost rank causes: the same class, so
`except HorovodInternalError` catches it. `run` recovers from it."""

logger = logging.getLogger(__name__)


class FatalToThisRank(Exception):
    """Raise it (or a subclass) on a rank that cannot go on: inside
    `kdist.elastic.run` that rank leaves the job, and the others carry on
    without it, as if it had died.

    The leaving rank writes `[kdist rank N] leaving the job: <message>` to
    stderr and kills itself, as a crash would, so that the others see it as
    dead and recover. In a world of one rank, or in a job not started
    fault-tolerant (`kdist run --elastic`), it ends the process with
    `SystemExit(1)` instead. Outside `run` it is an ordinary exception:

    ```python
    @kdist.elastic.run
    def train(state):
        if not gpu_is_healthy():
            raise kdist.elastic.FatalToThisRank("GPU lost")
        model.fit(...)
    ```
    """


def is_replacement():
    """True in a process that the survivors of an elastic job started to
    replace a lost rank (`kdist run --elastic --max-np`, `run(max_size=...)`);
    False in the ranks the job started with. Call it after `kdist.init()`.

    Example:

        >>> import kdist
        >>> kdist.init()
        >>> kdist.elastic.is_replacement()
        False
    """
    return processes.joined_late()


def min_ranks(min_size=None, environ=None):
    """The fewest ranks the job may shrink to: `min_size`, else
    `KDIST_ELASTIC_MIN_NP` (set by `kdist run --elastic --min-np`), else 1."""
    environ = os.environ if environ is None else environ
    value = min_size if min_size is not None else environ.get("KDIST_ELASTIC_MIN_NP", "1")
    return _rank_count(value, "minimum")


def max_ranks(max_size=None, environ=None):
    """The most ranks the job brings itself back to after losing some:
    `max_size`, else `KDIST_ELASTIC_MAX_NP` (set by `kdist run --elastic
    --max-np`), else None (lost ranks are not replaced)."""
    environ = os.environ if environ is None else environ
    value = max_size if max_size is not None else environ.get("KDIST_ELASTIC_MAX_NP")
    return None if value in (None, "") else _rank_count(value, "maximum")


def _rank_count(value, which):
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"The {which} number of ranks must be a whole number; got "
                         f"{value!r}.") from None
    if number < 1:
        raise ValueError(f"The {which} number of ranks must be at least 1; got {number}.")
    return number


def run(func=None, *, min_size=None, max_size=None):
    """Decorates `func(state, ...)` so that training carries on when ranks die.

    The decorated function is called as `func(state, *args, **kwargs)`, with a
    `State` first. Before each attempt every rank takes rank 0's state
    (`state.sync()`). When a collective fails because ranks died, the
    survivors revoke kdist's world and shrink it to themselves (ranks and
    size change; the world, local and cross communicators keep their
    identity, so code that holds them carries on), go back to the last commit
    (`state.restore()`), call the state's reset callbacks, and call `func`
    again. It returns what `func` returns, once the ranks agreed (uniformly)
    that no rank died meanwhile, so that no survivor leaves while others
    recover. A rank that raises `FatalToThisRank` leaves and the others carry
    on; `HostsUpdatedInterrupt`, raised by the state on every rank, makes
    `run` reset and call `func` again without restoring.

    Any other exception propagates unchanged on the rank that raised it; in a
    fault-tolerant job of several ranks, the other ranks then raise
    `RuntimeError` naming that rank and its error, so that the job ends on
    every rank instead of carrying on without it.

    With `max_size`, after shrinking, the survivors spawn processes running
    the same command line until the world has `max_size` ranks, as far as MPI
    finds slots for them (else a warning, and training goes on in the smaller
    world). A new process takes one of the highest ranks, joins the world in
    `kdist.init()` (`is_replacement()` is then True), builds its model, and
    receives the state in its first `state.sync()`, when it calls the
    decorated function; so the script must reach that call without
    collectives of its own. Its reset callbacks do not run. If the new
    processes die before they receive the state, no more are started. See
    the guide docs/elastic.md, "Replacing lost ranks".

    Needs a fault-tolerant launch (`kdist run --elastic`); elsewhere the
    decorated function, called on several ranks, logs a warning, and a rank
    that dies still ends the job.

    Args:
        func: the training function; `run` may also be called with keyword
            arguments only, as `@run(min_size=2)`.
        min_size: the fewest ranks training may go on with; default
            `KDIST_ELASTIC_MIN_NP` (set by `kdist run --elastic --min-np`),
            else 1.
        max_size: the number of ranks to bring the world back to after losing
            some; default `KDIST_ELASTIC_MAX_NP` (set by `--max-np`), else
            None: lost ranks are not replaced.

    Raises:
        ValueError: `min_size` or `max_size` (or the variable it defaults to)
            is not a number or is below 1, or `max_size` is below `min_size`
            (when decorating).
        TypeError: the decorated function's first argument is not a `State`.
        RuntimeError: fewer ranks than `min_size` survive (on every
            survivor, which ends the job); another rank raised an error.
        kdist.comm.recovery.NoQuorum: the ranks left, having lost ranks on
            other hosts, may be the smaller side of a network partition (see
            `KDIST_ELASTIC_QUORUM`).

    Example:

        >>> import kdist
        >>> state = kdist.elastic.ObjectState(epoch=0)
        >>> @kdist.elastic.run
        ... def train(state):
        ...     state.epoch += 1
        ...     return state.epoch
        >>> train(state)
        1
    """
    if func is None:
        return functools.partial(run, min_size=min_size, max_size=max_size)
    fewest = min_ranks(min_size)
    most = max_ranks(max_size)
    if most is not None and most < fewest:
        raise ValueError(f"max_size ({most}) is smaller than min_size ({fewest}).")

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not isinstance(state, State):
            raise TypeError("A function decorated with kdist.elastic.run takes a "
                            f"kdist.elastic State first; got {type(state).__name__}.")
        world = processes.world()
        if world.size > 1 and not ending.fault_tolerant():
            logger.warning("kdist.elastic.run: this job was not started fault-tolerant "
                           "(kdist run --elastic), so a rank that dies ends it.")
        reset = False
        replace_up_to = most
        # Replacements were started and have not received the state yet (the same
        # on every rank: a newcomer starts with it set).
        joining = processes.joined_late()
        while True:
            try:
                if reset:
                    state.on_reset()
                recovery.remember_processes()
                state.sync()
                joining = False
                result = func(state, *args, **kwargs)
                recovery.confirm_everyone_finished()
                return result
            except FatalToThisRank as error:
                _leave(error)
            except HostsUpdatedInterrupt:
                pass
            except Exception as error:
                lost = recovery.caused_by_lost_ranks(error)
                if not lost and (world.size == 1 or not ending.fault_tolerant()):
                    raise
                # A bug on one rank: revoking and shrinking with the others brings
                # them out of the collectives they wait in, to end the job together.
                recovery.shrink_world()
                _end_if_any_rank_failed(None if lost else error, world)
                if joining and replace_up_to is not None:
                    # The script fails before it reaches this function on a new
                    # process; starting more would fail the same way, forever.
                    logger.warning("The rank(s) started to replace lost ones died before they "
                                   "received the state; not starting more.")
                    replace_up_to = None
                if replace_up_to is not None:
                    before = world.size
                    joining = recovery.grow_world(replace_up_to) > before
                if world.size < fewest:
                    raise RuntimeError(
                        f"Only {world.size} rank(s) are left, fewer than the {fewest} this "
                        "job needs (min_size / --min-np); ending it.") from error
                state.restore()
            reset = True

    return wrapper


def _end_if_any_rank_failed(error, world):
    """Re-raises `error` here and raises on every other rank if any rank had one.

    Collective over the (shrunk) world. Without it the others would take the
    failing rank's end for a death and carry on without it, or not, depending
    on which was quicker: the launcher or their recovery.
    """
    reports = world.allgather_object(None if error is None
                                     else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, text) for rank, text in enumerate(reports) if text is not None]
    if failed:
        rank, text = failed[0]
        raise RuntimeError(f"rank {rank} failed ({text}); ending the job on every rank.")


def _leave(error):
    rank = processes.rank()
    sys.stderr.write(f"[kdist rank {rank}] leaving the job: {error}\n")
    sys.stderr.flush()
    logging.shutdown()
    if processes.size() == 1 or not ending.fault_tolerant():
        raise SystemExit(1)
    # As a crash does: the others must see this rank as dead, and the launcher
    # ends a fault-tolerant job when a rank exits with an error status instead.
    os.kill(os.getpid(), signal.SIGKILL)
