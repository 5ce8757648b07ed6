"""The serving loop of the master and of sub-masters.

A server keeps one receive posted per child and answers whichever child's
message lands first: fold it into the centre with the mode's rule, copy the
reply into that child's own buffer, start a non-blocking send, post the next
receive. Nothing else happens on that path: the top master's validation,
callbacks and checkpoints run on another thread from snapshots the server
hands over at each epoch's end (`events`).

A sub-master is a server whose centre is, in turn, a child of the master's:
it reports the change of its centre upwards after every round of its
children's updates, at each epoch's end and when its children are done.

One worker's exchange (t = the trainable values, `Layout.trainable_size`):

    worker, every sync_every steps, at each epoch's end and at the last (WorkerSession._sync):
      body = the replica's values         | trainable [:t] | non-trainable [t:] |
      body[:t] -= pulled[:t]              Downpour, GEM: the update since the last
                                          pull; EASGD sends the weights themselves
        | ServerExchange.exchange: header (kind, epoch, steps) + body, tag UP
        v
    server._serve: mailbox.wait_any() -> child; outbox.wait(child)
      stale = clock - pulled_at[child]    reply[child] still holds what it pulled
      center = rule.absorb(child, body, center, reply[child], stale), on [:t]:
        Downpour  reply = center stepped by the master optimizer     -> center
        GEM       reply = center + body * energy-matching factor     -> center
        EASGD     center += a (w - center); reply = w - a (w - center), a = elastic_force
      center[t:] = reply[t:] = body[t:]   the latest child's statistics
      center_hook(center, clock, reply); clock += 1
        | reply header (kind, epoch, stop) + body, tag DOWN;
        | pulled_at[child] = clock; the child's receive is posted again
        v
    worker: the replica takes the reply; it stays as `pulled` for the next update
"""

import collections
import logging
import queue
import threading
import time

import numpy as np

from kdist.comm import p2p
from kdist.ps import algorithms, messages

logger = logging.getLogger(__name__)


def _nothing():
    pass


def mean_logs(logs_by_child):
    """The mean of each metric over the children that reported it."""
    totals = collections.defaultdict(list)
    for logs in logs_by_child.values():
        for key, value in logs.items():
            totals[key].append(value)
    return {key: float(np.mean(values)) for key, values in totals.items()}


class Server:
    """Serves `children` (ranks of `comm`) around the flat vector `center`.

    The serving loop of the master, of shard servers and of sub-masters; get
    one from `ParameterServerStrategy.make_server(models)` for a custom loop
    and call `run()` (on a thread of its own at the top, whose other thread
    reads `events`). A top server puts `("epoch", epoch, logs, snapshot)` on
    `events` when every child has finished an epoch (`logs`: the children's
    mean metrics; `snapshot`: `center`, `clock`, `rule` state and `stats`),
    then `("done", stats)` when every child is done, or `("error", exception)`.
    `request_stop()` asks every child to stop after its current step.

    Args:
        comm: the job's `kdist.comm.Communicator`.
        children: ranks that send updates to this server.
        center: float32 vector (`Layout.size` long); updated in place.
        trainable_size: how many leading values the rule updates; the rest
            (e.g. batch-norm statistics) are copied from the latest child.
        rule: from `kdist.ps.rules`.
        link: for a sub-master, its `kdist.ps.exchange.ServerExchange` to the server
            above; None at the top.
        report_every: a sub-master reports up after this many updates
            (default: one per child).
        first_epoch: the epoch a resumed run starts at.
        clock: the update count a resumed run starts at.
        center_hook: called as `hook(center, clock, reply)` after each update
            is folded in, before the reply goes out (the master's pruning
            masks, `kdist.ps.masks`).
        slots: a `kdist.ps.shared.SharedSlots`: children on this node then
            exchange through shared memory, the others by message.
        offset: where `center` starts in the children's whole vector, for a
            server that holds one shard of it (`ParameterServerStrategy(servers=K)`).
        receives_logs: whether children send this server their epoch logs
            (only the first of several top servers gets them).
    """

    def __init__(self, comm, children, center, trainable_size, rule, link=None,
                 report_every=None, first_epoch=0, clock=0, center_hook=None, slots=None,
                 offset=0, receives_logs=True):
        self.comm = comm
        self.children = list(children)
        self.center = center
        self.trainable_size = trainable_size
        self.rule = rule
        self.link = link
        self.center_hook = center_hook
        self.slots = slots
        self.offset = int(offset)
        self.receives_logs = receives_logs
        self.report_every = report_every or len(self.children)
        self.clock = clock
        self.pulled_at = {child: clock for child in self.children}
        self.staleness = collections.Counter()
        self.next_epoch = first_epoch
        self.events = queue.Queue()
        self.busy_seconds = 0.0
        self.wait_seconds = 0.0
        self.cpu_seconds = 0.0
        self.shared_children = 0
        self._reports = collections.defaultdict(dict)
        self._done = set()
        self.lost = []
        self._stop = threading.Event()
        self._since_report = 0
        if link is not None:
            link.reply.body[:] = center
            self._own_center = np.empty_like(center)

    # Called from other threads.
    def request_stop(self):
        """Asks every child to stop after its current step (early stopping)."""
        self._stop.set()

    @property
    def stopping(self):
        return self._stop.is_set()

    def stats(self):
        """The serving statistics as a dict: `updates`, `staleness_mean`,
        `staleness_max`, `staleness_histogram` (staleness -> count),
        `utilisation` (share of the serving time spent working), `busy_seconds`,
        `cpu_seconds` (the serving thread's), `shared_children` (children served
        through shared memory), `clock` and `lost` (children that died)."""
        counts = self.staleness
        total = sum(counts.values())
        mean = sum(k * v for k, v in counts.items()) / total if total else 0.0
        elapsed = self.busy_seconds + self.wait_seconds
        return {"updates": total, "staleness_mean": mean,
                "staleness_max": max(counts) if counts else 0,
                "staleness_histogram": {int(k): int(v) for k, v in sorted(counts.items())},
                "utilisation": self.busy_seconds / elapsed if elapsed else 0.0,
                "busy_seconds": self.busy_seconds, "cpu_seconds": self.cpu_seconds,
                "shared_children": self.shared_children,
                "clock": self.clock,
                "lost": list(self.lost)}

    def run(self):
        """Serves until every child is done. At the top, ends with a "done" event,
        or an "error" event carrying the exception."""
        cpu_started = time.thread_time()
        try:
            self._serve()
        except BaseException as error:  # handed to the thread that runs fit
            if self.link is not None:
                raise
            self.events.put(("error", error))
            return
        finally:
            self.cpu_seconds += time.thread_time() - cpu_started
        if self.link is None:
            self.events.put(("done", self.stats()))

    def _serve(self):
        size = self.center.shape[0]
        incoming, replies = {}, {}
        share = slice(self.offset, self.offset + size)
        for child in self.children:
            bodies = self.slots.child_bodies(child) if self.slots is not None else None
            if bodies is None:
                incoming[child], replies[child] = messages.Message(size), messages.Message(size)
            else:
                incoming[child], replies[child] = (messages.Message(size, body=b[share])
                                                   for b in bodies)
            replies[child].body[:] = self.center
        self.shared_children = sum(m.shared for m in incoming.values())
        mailbox = p2p.Mailbox(self.comm, {c: m.wire for c, m in incoming.items()}, messages.UP)
        sync = self.slots.sync if self.slots is not None else _nothing
        outbox = p2p.Outbox(self.comm, messages.DOWN)
        live = set(self.children)
        t = self.trainable_size
        try:
            while live:
                waited_from = time.perf_counter()
                try:
                    child = mailbox.wait_any()
                except p2p.PeerFailed as failure:
                    self._lose(failure.ranks, live, outbox)
                    continue
                started = time.perf_counter()
                self.wait_seconds += started - waited_from
                sync()
                message, reply = incoming[child], replies[child]
                outbox.wait(child)
                stale = algorithms.staleness(self.clock, self.pulled_at[child])
                self.staleness[stale] += 1
                self.center = self.rule.absorb(child, message.body, self.center, reply.body,
                                               stale)
                self.center[t:] = message.body[t:]
                reply.body[t:] = message.body[t:]
                if self.center_hook is not None:
                    self.center_hook(self.center, self.clock,
                                     None if reply.body is self.center else reply.body)
                self.clock += 1
                self._since_report += 1
                kind = message.kind
                if kind == messages.EPOCH_END:
                    logs = (p2p.recv_object(self.comm, child, messages.LOGS)
                            if self.receives_logs else {})
                    self._reports[message.epoch][child] = logs
                elif kind == messages.DONE:
                    live.discard(child)
                    self._done.add(child)
                reply.set(kind=kind, epoch=message.epoch, stop=self.stopping)
                sync()
                outbox.send(child, reply.wire)
                self.pulled_at[child] = self.clock
                if kind != messages.DONE:
                    mailbox.rearm(child)
                self.busy_seconds += time.perf_counter() - started
                if kind != messages.EXCHANGE:
                    self._close_epochs()
                if self.link is not None and live and self._since_report >= self.report_every:
                    self._report_up(messages.EXCHANGE)
            outbox.flush()
        finally:
            mailbox.close()
        if self.link is not None:
            self._report_up(messages.DONE)

    def _lose(self, ranks, live, outbox):
        """Carries on without children that died (MPI fault tolerance is on)."""
        for rank in ranks:
            live.discard(rank)
            self._done.add(rank)
            outbox.forget(rank)
            self.lost.append(rank)
        logger.warning("Rank(s) %s died; carrying on with the %d other child(ren) of this "
                       "server: %s.", ranks, len(live), sorted(live))
        if not live and len(self.lost) == len(self.children):
            raise RuntimeError(f"Every child of this server died: {sorted(self.lost)}.")
        self._close_epochs()

    def _close_epochs(self):
        """Hands over every epoch that all children finished (or left)."""
        while True:
            reports = self._reports.get(self.next_epoch)
            if not reports or any(c not in reports and c not in self._done
                                  for c in self.children):
                return
            epoch, logs = self.next_epoch, mean_logs(self._reports.pop(self.next_epoch))
            self.next_epoch += 1
            if self.link is not None:
                self._report_up(messages.EPOCH_END, epoch, logs)
            elif not self.stopping:
                snapshot = {"center": self.center.copy(), "clock": self.clock,
                            "rule": {k: np.array(v) for k, v in self.rule.get_state().items()},
                            "stats": self.stats()}
                self.events.put(("epoch", epoch, logs, snapshot))

    def _report_up(self, kind, epoch=0, logs=None):
        """A sub-master's exchange with its own server."""
        started = time.perf_counter()
        link, t = self.link, self.trainable_size
        body = link.message.body
        if self.rule.sends_weights:
            body[:] = self.center
        else:
            np.subtract(self.center[:t], link.reply.body[:t], out=body[:t])
            body[t:] = self.center[t:]
        reply = link.exchange(kind, epoch=epoch, steps=self.clock, logs=logs)
        # The centre may be a child's reply buffer (see rules): take our own.
        np.copyto(self._own_center, reply.body)
        self.center = self._own_center
        if reply.stop:
            self._stop.set()
        self._since_report = 0
        self.busy_seconds += time.perf_counter() - started
