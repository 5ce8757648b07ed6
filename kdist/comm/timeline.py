"""A Chrome-trace timeline of every collective on every rank.

While it records, each phase of each collective becomes one span: `negotiate`
(every rank announcing the collective: the time spent waiting for the slowest
rank), the data movement (`allreduce`, `allgather`, `broadcast`, ...), and in
fused gradient reductions `pack`, `unpack` and `scale`. Python-side
collectives appear on one track of each rank, the in-graph (C++) ones on
another.

Each rank writes its spans next to the file; rank 0 then merges every
rank's part into the one file, which opens in `chrome://tracing` or
Perfetto. Nothing here is a collective, so a rank that stops early cannot
hang the others.

Example:

    >>> import kdist
    >>> kdist.start_timeline("/tmp/kdist-timeline.json")
    >>> kdist.allreduce([1.0, 2.0], name="example")
    array([1., 2.])
    >>> kdist.stop_timeline()
    '/tmp/kdist-timeline.json'
"""

import atexit
import contextlib
import json
import logging
import os
import threading
import time

logger = logging.getLogger("kdist")

_lock = threading.Lock()
_recording = False
_path = None
_spans = []  # (phase, what, start_ns, end_ns, bytes)
# Whether the timeline that records now was started by KDIST_TIMELINE.
_from_environment = False
_stop_at_exit_registered = False
_SPAN_LIMIT = 2_000_000
_PYTHON_TRACK, _GRAPH_TRACK = 0, 1


def recording():
    """Whether a timeline records now."""
    return _recording


@contextlib.contextmanager
def span(phase, what, nbytes=0):
    """Records the enclosed code as one phase of a Python-side collective."""
    if not _recording:
        yield
        return
    start = time.time_ns()
    try:
        yield
    finally:
        if len(_spans) < _SPAN_LIMIT:
            _spans.append((phase, what, start, time.time_ns(), int(nbytes)))


def start_timeline(file_path, mark_cycles=False):
    """Starts recording every collective of this rank; `stop_timeline` writes `file_path`.

    Each collective is recorded phase by phase: `negotiate` (waiting for every rank to
    announce it: the time spent waiting for the slowest rank), `pack`, the data
    movement (`allreduce`, `allgather`, `broadcast`, ...), `unpack` and `scale`.
    Collectives that run in Python and those that run in kdist's C++ ops show on two
    tracks of each rank. The file is a Chrome trace, which opens in `chrome://tracing`
    or Perfetto.

    Call `start_timeline` and `kdist.stop_timeline` on every rank with the same path:
    each rank writes its part and rank 0 merges the parts into `file_path`. Neither is
    a collective, so a rank that stops early cannot hang the others.
    `KDIST_TIMELINE=path` (or Horovod's `HOROVOD_TIMELINE`) starts a timeline at
    `kdist.init()` and writes it at `kdist.shutdown()` or when the process ends
    (`KDIST_TIMELINE_MARK_CYCLES=1` sets `mark_cycles`). See "Timeline" in the
    data-parallel guide.

    Args:
        file_path: the Chrome-trace JSON file to write.
        mark_cycles: also mark the start of each fused gradient reduction
            (one per training step) with an instant event.

    Raises:
        ValueError: the directory of `file_path` does not exist.
        PermissionError: the directory of `file_path` is not writable.
        RuntimeError: a timeline is already recording; call `stop_timeline` first.
    """
    global _recording, _path
    from kdist.comm import native

    path = os.path.abspath(os.fspath(file_path))
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise ValueError(f"Cannot write a timeline to {file_path!r}: the directory "
                         f"{directory!r} does not exist.")
    if not os.access(directory, os.W_OK):
        raise PermissionError(f"Cannot write a timeline to {file_path!r}: the directory "
                              f"{directory!r} is not writable.")
    with _lock:
        if _recording:
            raise RuntimeError(f"A timeline already records to {_path!r}; call "
                               "kdist.stop_timeline() first.")
        _spans.clear()
        native.take_timeline_lines()  # drops what an earlier timeline left
        _path, _recording = path, True
        native.set_timeline_mode(2 if mark_cycles else 1)


def stop_timeline():
    """Stops recording and writes the timeline (rank 0 merges every rank's part).

    Every rank writes its part beside the file; rank 0 waits up to
    `KDIST_TIMELINE_WAIT` seconds (default 30) for the other ranks' parts, merges them
    into the file and removes them. Parts that do not appear in time (a rank that
    ended first, a file system that the other nodes do not share) are named in a
    warning and left out.

    Returns the path of the file this rank wrote: the merged timeline on rank
    0, its own part elsewhere; None when no timeline was recording.
    """
    global _recording
    from kdist.comm import native
    from kdist.comm import job

    with _lock:
        if not _recording:
            return None
        _recording = False
        native.set_timeline_mode(0)
        events = _events(job.rank(), native.take_timeline_lines())
        _spans.clear()
        path = _path
    rank, size = job.rank(), job.size()
    part = _part_path(path, rank)
    _write_json(part, events)
    if rank != 0:
        return part
    merge(path, size)
    return path


def merge(path, size, wait_seconds=None):
    """Merges the parts of ranks 0..size-1 into `path`, waiting a while for late ranks.

    Parts that do not appear in time (a rank that ended first, a file system
    that other nodes do not share) are named in a warning and left out; the
    parts that did appear are removed.
    """
    if wait_seconds is None:
        wait_seconds = float(os.environ.get("KDIST_TIMELINE_WAIT", "30"))
    deadline = time.monotonic() + wait_seconds
    parts = {r: _part_path(path, r) for r in range(size)}
    while time.monotonic() < deadline and not all(os.path.exists(p) for p in parts.values()):
        time.sleep(0.05)
    events, found = [], []
    for r, part in parts.items():
        try:
            with open(part) as stream:
                events.extend(json.load(stream))
        except (OSError, ValueError):
            continue
        found.append(r)
    missing = sorted(set(parts) - set(found))
    if missing:
        logger.warning("timeline: no part from rank(s) %s after %.0f s; %s holds the other "
                       "ranks only", missing, wait_seconds, path)
    timed = [e["ts"] for e in events if "ts" in e]
    origin = min(timed) if timed else 0
    for event in events:
        if "ts" in event:
            event["ts"] = round(event["ts"] - origin, 3)
    _write_json(path, {"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"ranks": size, "origin_unix_us": origin}})
    for r in found:
        with contextlib.suppress(OSError):
            os.remove(parts[r])
    return path


def _part_path(path, rank):
    return f"{path}.rank{rank}.part"


def _write_json(path, content):
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w") as stream:
        json.dump(content, stream)
    os.replace(temporary, path)


def _events(rank, native_lines):
    events = [
        {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}},
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": _PYTHON_TRACK,
         "args": {"name": "Python collectives"}},
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": _GRAPH_TRACK,
         "args": {"name": "in-graph collectives"}},
    ]
    for phase, what, start, end, nbytes in _spans:
        events.append(_event(rank, _PYTHON_TRACK, phase, what, start, end, nbytes))
    for line in native_lines.splitlines():
        fields = line.split("\t", 4)
        if len(fields) != 5:
            continue
        phase, start, end, nbytes, what = fields
        events.append(_event(rank, _GRAPH_TRACK, phase, what, int(start), int(end),
                             int(nbytes)))
    return events


def _event(rank, track, phase, what, start_ns, end_ns, nbytes):
    if phase == "cycle":
        return {"ph": "i", "s": "p", "name": "cycle", "pid": rank, "tid": track,
                "ts": start_ns / 1e3, "args": {"what": what}}
    return {"ph": "X", "name": phase, "cat": "collective", "pid": rank, "tid": track,
            "ts": start_ns / 1e3, "dur": (end_ns - start_ns) / 1e3,
            "args": {"what": what, "bytes": nbytes}}


def start_from_environment():
    """Starts the timeline that `KDIST_TIMELINE` (or Horovod's `HOROVOD_TIMELINE`) names."""
    path = os.environ.get("KDIST_TIMELINE") or os.environ.get("HOROVOD_TIMELINE")
    if not path or _recording:
        return
    mark = os.environ.get("KDIST_TIMELINE_MARK_CYCLES",
                          os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "0"))
    global _from_environment
    start_timeline(path, mark_cycles=mark.lower() in ("1", "true", "yes"))
    _from_environment = True
    if not _stop_at_exit_registered:
        _register_stop_at_exit()
    logger.info("timeline: recording every collective to %s", path)


def _register_stop_at_exit():
    global _stop_at_exit_registered
    _stop_at_exit_registered = True
    atexit.register(stop_timeline)


def stop_started_from_environment():
    """Writes the timeline `KDIST_TIMELINE` started, if one records (`kdist.shutdown`
    calls this; the process's end does too, for a script that does not shut down)."""
    global _from_environment
    if _from_environment:
        _from_environment = False
        stop_timeline()
