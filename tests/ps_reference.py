"""Replays a recorded parameter-server job with numpy versions of the update rules.

`workers/ps_record.py` records, on every rank, the messages that really
travelled and the order in which each server absorbed them. `replay` feeds
those messages, in that order, through the rules as the literature writes
them and measures how far the replies the ranks received are from the
replies the rules give. It never calls kdist: a server that skips updates,
applies the wrong rule, averages instead of adding, or miscounts staleness
gives replies (or statistics) the replay does not.

Each server is replayed one absorbed message at a time. For the rules whose
reply is the new centre (Downpour, GEM) the replay carries on from the
centre the child really received, so every message is checked on its own
and float32 rounding does not pile up; EASGD's centre is never sent whole,
so it is carried by the replay itself.
"""

import collections
import os
import pickle

import numpy as np


class Rules:
    """The settings of one replay: mode and its parameters, at the top master.

    Sub-masters add their workers' updates plainly (or run the elastic
    exchange in EASGD), whatever the top master does. An EASGD worker sends
    the weights it resumed from plus `step_scale` times its progress since.
    """

    def __init__(self, mode, elastic_force=0.5, gem_kappa=1.5, gem_momentum=0.9,
                 staleness_aware=False, momenta=None, step_scale=1.0):
        self.mode = mode
        self.elastic_force = np.float32(elastic_force)
        self.step_scale = np.float32(step_scale)
        self.kappa, self.mu = np.float32(gem_kappa), np.float32(gem_momentum)
        self.staleness_aware = staleness_aware
        self.momenta = {c: np.array(m, np.float32) for c, m in (momenta or {}).items()}

    def copy(self):
        """The same rules, from the same starting momenta (a replay updates its own)."""
        return Rules(self.mode, self.elastic_force, self.kappa, self.mu,
                     self.staleness_aware, self.momenta, self.step_scale)

    @property
    def sends_weights(self):
        return self.mode == "easgd"

    def intermediate(self):
        if self.mode == "easgd":
            return Rules("easgd", elastic_force=self.elastic_force)
        return Rules("downpour")

    def absorb(self, child, message, center, pulled, stale):
        """(new centre, reply to the child) for one message; `pulled` is the
        centre the child received last time."""
        factor = np.float32(1.0 / max(1, stale) if self.staleness_aware else 1.0)
        if self.mode == "downpour":
            new = center + factor * message if factor != 1 else center + message
            return new, new
        if self.mode == "easgd":
            # w <- w - a (w - c), c <- c + a (w - c)
            pull = self.elastic_force * (message - center)
            return center + pull, message - pull
        if self.mode == "gem":
            momentum = self.momenta.setdefault(child, np.zeros_like(message))
            momentum *= self.mu
            momentum += message
            drift = center - pulled
            scale = (self.kappa * np.abs(momentum) - np.abs(drift)) / (
                np.abs(message) + np.float32(1e-8))
            step = message * np.clip(scale, 0.0, 5.0).astype(np.float32)
            if factor != 1:
                step = step * factor
            new = center + step
            return new, new
        raise ValueError(self.mode)


def load(directory):
    """rank -> `RankRecord` for every rank that recorded into `directory`."""
    records = {}
    for name in os.listdir(directory):
        if name.startswith("ps-") and name.endswith(".pkl"):
            events = []
            with open(os.path.join(directory, name), "rb") as f:
                while True:
                    try:
                        events.append(pickle.load(f))
                    except Exception:  # the end, or an event cut short by an abort
                        break
            records[int(name[3:-4])] = RankRecord(events)
    return records


class RankRecord:
    """One rank's events, sorted into what a test asks about."""

    def __init__(self, events):
        self.events = events
        self.server = next((e for e in events if e[0] == "server"), None)
        self.steps = [e[1] for e in events if e[0] == "step"]
        self.sends = [dict(zip(("kind", "epoch", "steps", "weights", "body"), e[1:]))
                      for e in events if e[0] == "send"]
        self.replies = [e[1] for e in events if e[0] == "reply"]

    def after_first_stop(self):
        """The events after the first reply that asked this rank to stop, or None."""
        for i, event in enumerate(self.events):
            if event[0] == "reply" and event[2]:
                return self.events[i + 1:]
        return None


class Replay:
    """What replaying a job found. Deviations are max absolute differences."""

    def __init__(self):
        self.reply_deviation = 0.0      # replies the children got vs the rules'
        self.up_deviation = 0.0         # what sub-masters sent up vs what they should
        self.worker_deviation = 0.0     # what workers sent / started from vs their replies
        self.stale_mismatches = 0       # staleness the server used vs the replay's count
        self.histograms = {}            # server rank -> Counter of staleness
        self.absorbed = {}              # server rank -> number of messages absorbed
        self.centers = {}               # server rank -> centre after its last message
        self.momenta = {}               # the top rule's momenta after the last message

    def _note(self, name, a, b):
        if a is None or b is None:
            return
        setattr(self, name, max(getattr(self, name), float(np.max(np.abs(a - b)))))


def replay(records, rules, until=None):
    """Replays every server (top master = rank 0) and checks every worker.

    `until(child, index, sent)` is asked after each message the top master
    absorbs (the child's `index`-th, a `RankRecord.sends` entry); True ends
    the replay there, at the state an epoch's snapshot saw.
    """
    result = Replay()
    rules = rules.copy()
    servers = sorted(r for r, rec in records.items() if rec.server is not None)
    workers = sorted(r for r, rec in records.items() if rec.server is None)
    for rank in servers:
        _replay_server(records, rank, rules if rank == 0 else rules.intermediate(), result,
                       until if rank == 0 else None)
    _, _, start, trainable = records[0].server
    for rank in workers:
        _check_worker(records[rank], start, trainable, rules, result)
    return result


def _replay_server(records, rank, rules, result, until):
    _, children, start, t = records[rank].server
    center = start.copy()
    pulled = {child: start.copy() for child in children}
    pulled_at = {child: 0 for child in children}
    taken = collections.Counter()
    histogram = collections.Counter()
    clock = 0
    up_pulled = start.copy()  # a sub-master's last reply from its own server
    for event in records[rank].events:
        if event[0] == "absorb":
            child, stale_used = event[1], event[2]
            index = taken[child]
            taken[child] += 1
            sent = records[child].sends[index]
            stale = clock - pulled_at[child]
            histogram[stale] += 1
            result.stale_mismatches += int(stale != stale_used)
            message = sent["body"]
            new, reply = rules.absorb(child, message[:t], center[:t], pulled[child][:t], stale)
            new = np.concatenate([new, message[t:]])
            reply = np.concatenate([reply, message[t:]])
            got = records[child].replies[index] if index < len(records[child].replies) else None
            result._note("reply_deviation", reply, got)
            if rules.sends_weights or got is None:
                center = new
            else:
                center = got.copy()
            pulled[child] = reply if got is None else got
            clock += 1
            pulled_at[child] = clock
            if until is not None and until(child, index, sent):
                break
        elif event[0] == "send":
            body = event[5]
            expected = center.copy() if rules.sends_weights else np.concatenate(
                [center[:t] - up_pulled[:t], center[t:]])
            result._note("up_deviation", expected, body)
        elif event[0] == "reply":
            center = event[1].copy()
            up_pulled = event[1].copy()
    result.histograms[rank] = histogram
    result.absorbed[rank] = clock
    result.centers[rank] = center
    if rank == 0:
        result.momenta = {c: m.copy() for c, m in rules.momenta.items()}


def _check_worker(record, start, t, rules, result):
    """The worker starts from the centre, sends its (stretched) weights (EASGD)
    or their change since the last reply, and starts its next step from the reply."""
    if record.steps:
        result._note("worker_deviation", record.steps[0], start)
    pulled = start
    starts_from = {}
    for index, sent in enumerate(record.sends):
        weights = sent["weights"]
        if weights is not None:
            if not rules.sends_weights:
                trained = weights[:t] - pulled[:t]
            elif rules.step_scale != 1:
                trained = pulled[:t] + rules.step_scale * (weights[:t] - pulled[:t])
            else:
                trained = weights[:t]
            expected = np.concatenate([trained, weights[t:]])
            result._note("worker_deviation", expected, sent["body"])
        if index >= len(record.replies):
            break
        pulled = record.replies[index]
        starts_from[sent["steps"]] = pulled
    for step, reply in starts_from.items():
        if step < len(record.steps):
            result._note("worker_deviation", record.steps[step], reply)


TOLERANCE = 1e-5


def check(directory, rules, stats=None, final_weights=()):
    """Replays the job recorded in `directory` and asserts that every rank did
    what `rules` say: each reply, each worker's message and starting point,
    each sub-master's report, the staleness each server counted, and that no
    message went unabsorbed. `stats` is the top master's `strategy.stats`;
    `final_weights` are what ranks hold after fit. Returns the `Replay`."""
    records = load(directory)
    result = replay(records, rules)
    for name in ("reply_deviation", "up_deviation", "worker_deviation"):
        assert getattr(result, name) < TOLERANCE, (name, getattr(result, name))
    assert result.stale_mismatches == 0, "the staleness a server used is not the count"
    for rank, record in records.items():
        if record.server is not None:
            children = record.server[1]
            sent = sum(len(records[c].sends) for c in children if c in records)
            assert result.absorbed[rank] == sent, (rank, result.absorbed[rank], sent)
    if stats is not None:
        assert stats["updates"] == result.absorbed[0]
        histogram = {int(k): v for k, v in stats["staleness_histogram"].items()}
        assert histogram == dict(result.histograms[0])
    for weights in final_weights:
        np.testing.assert_allclose(np.asarray(weights, np.float32), result.centers[0],
                                   atol=TOLERANCE, rtol=0)
    return result


def deviation(directory, rules):
    """How far the replies recorded in `directory` are from what `rules` give."""
    return replay(load(directory), rules).reply_deviation
