"""Leaving the job: a rank whose script ends says so, so that no rank waits for it.

A rank that leaves a training loop early (a callback stopped its `fit` on
that rank alone, or its data ran out) and then ends its script leaves the
other ranks waiting in a collective that it will never start. So, as its
process ends, each rank of a world of several announces a LEAVE on kdist's
world communicator, through the wire protocol every collective follows
(`kdist.comm.protocol`):

- when every rank leaves, the headers match and every process ends as usual,
  whenever each got there (ranks may end at different times: the wait at
  exit is exempt from the watchdog's timeouts, like `MPI_Finalize`);
- when another rank is waiting in a collective (in Python or in the C++
  engine), the headers differ and both see `CollectiveMismatch` at once: the
  waiting rank fails with a report naming the rank that left and why (its
  script ended, and how its last `fit` ended when kdist's callbacks recorded
  it), and the job ends;
- a rank waiting in `kdist.join()` learns that a rank left instead of
  running out of data, and fails saying so.

Nothing is announced in a world of one, after `kdist.shutdown()`, after MPI
was finalized, or in a fault-tolerant or elastic job (`kdist.comm.ending`
ends those); an uncaught exception has already aborted the job by then.
"""

import atexit
import logging
import sys
import time

from kdist.comm import job
from kdist.comm import protocol
from kdist.comm import watchdog

logger = logging.getLogger(__name__)

# How long a rank that left waits for the ranks it found in a collective to end the job
# with their own report before it ends the job itself.
GRACE_SECONDS = 5.0

_installed = False


def install():
    """Arranges for this process to announce its leaving at exit (once).

    Registered after the watchdog's own exit handler, so it runs before it
    (the monitor still answers other ranks meanwhile), and before the
    timeline's, so it runs after a timeline has been merged.
    """
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(leave)


def description():
    """What this rank says as it leaves, with the note on its last `fit` if it has one."""
    text = "leaving the job: its script ended"
    note = protocol.note()
    return f"{text}; {note}" if note else text


def _should_leave():
    from kdist.comm import ending

    state = job._state
    if not state.initialized or state.world is None or state.world.mpi is None:
        return False
    if state.world.size == 1 or ending.fault_tolerant() or state.generation > 0:
        return False
    try:
        from mpi4py import MPI
    except ImportError:
        return False
    return MPI.Is_initialized() and not MPI.Is_finalized()


def leave():
    """Announces that this rank leaves the job; returns when every rank has left.

    Called at exit. When another rank is still in a collective, both fail with
    `CollectiveMismatch`; this rank writes its side, gives the other ranks
    `GRACE_SECONDS` to end the job with their own report, and ends it otherwise.
    """
    if not _should_leave():
        return
    world = job._state.world
    what = description()
    if not world.lock.acquire(timeout=5):
        # Another thread of this process is inside a collective and will not come back.
        logger.warning("could not announce leaving the job: another thread holds kdist's "
                       "world communicator")
        return
    try:
        protocol.announce(world.mpi, protocol.LEAVE, what=what, state=watchdog.LEAVING)
        with watchdog.waiting(what, watchdog.LEAVING):
            notes = world.mpi.allgather(what)
    except protocol.CollectiveMismatch as error:
        sys.stderr.write(f"[kdist rank {world.rank}] {error}\n")
        sys.stderr.flush()
        time.sleep(GRACE_SECONDS)
        watchdog.abort(f"rank {world.rank} ended its script while other ranks were still "
                       "running collectives (listed above)")
        return
    finally:
        world.lock.release()
    waiting = [rank for rank, text in enumerate(notes)
               if not str(text).startswith("leaving the job")]
    if waiting:
        logger.warning("rank(s) %s were waiting in kdist.join when this rank left the job; "
                       "they fail", waiting)


def fail_join(rank, notes):
    """The error a rank waiting in `kdist.join()` raises when other ranks left instead."""
    left = [(r, text) for r, text in enumerate(notes) if str(text).startswith("leaving")]
    who = "; ".join(f"rank {r} is {text}" for r, text in left)
    return protocol.CollectiveMismatch(
        f"kdist.join on rank {rank}: {who}, while this rank waits in kdist.join for the "
        "other ranks to run out of data. Every rank must call kdist.join() (kdist's "
        "callbacks do at each epoch's end) before its script ends; a rank that stopped "
        "its fit early leaves the others' loops unfinished.")
