"""How each rank of a `kdist run` job ended, whatever the launcher's exit status says.

Every rank runs under kdist/_prefix.py, which writes a start line and an end line
(marked with the run's token) into its output. `kdist run` relays the launcher's
output through `relay_records`, which takes those lines out and keeps them; `Ends`
then decides the job's exit status and says which ranks ended how.

Why not trust the launcher alone: when a host vanishes, Open MPI's launcher may end
the job with status 0 ("lost communication with a remote daemon"), and a batch
script or a search driver would read a lost training as a finished one. A rank that
started and never wrote its end line did not end cleanly, whichever way it went.
"""

import dataclasses
import os
import signal


@dataclasses.dataclass
class RankEnd:
    rank: str
    host: str = "?"
    pid: str = "?"
    code: int = None  # None: started, never reported an end
    gave_up_starting: bool = False  # its start-up clock ran out (KDIST_START_TIMEOUT)
    left_running: bool = False  # the launcher exited without it; kdist run ended it

    def clean(self):
        return self.code == 0 and not self.gave_up_starting

    def how(self):
        if self.gave_up_starting:
            return (f"gave up waiting for the others to start (KDIST_START_TIMEOUT) on host "
                    f"{self.host}")
        if self.code is None and self.left_running:
            return f"{{was}} left running by the launcher on host {self.host} (kdist run " \
                   f"ended {{it}})"
        if self.code is None:
            return f"never reported {{its}} end (host {self.host}: lost, or the rank was " \
                   f"killed with its wrapper)"
        if self.code == 0:
            return "ended cleanly"
        if self.code < 0:
            try:
                name = signal.Signals(-self.code).name
            except ValueError:
                name = f"signal {-self.code}"
            return f"was killed by {name} on host {self.host}"
        return f"exited with status {self.code} on host {self.host}"


def _fields(text):
    fields = {}
    for part in text.split()[1:]:
        name, _, value = part.partition("=")
        fields[name] = value
    return fields


class Ends:
    """The start and end lines of one run, by rank."""

    def __init__(self, expected):
        self.expected = int(expected)
        self.ranks = []  # RankEnd, in order of start; a replacement rank adds one more
        self.world = None  # the ranks an elastic job went on with, once it changed
        self.cannot_start = False  # a rank's start-up clock ran out: the job cannot go on

    def add(self, text):
        fields = _fields(text)
        event = text.split(" ", 1)[0]
        rank, pid = fields.get("rank", "?"), fields.get("pid", "?")
        if event == "world":
            self.world = [r for r in fields.get("ranks", "").split(",") if r]
        elif event == "start":
            self.ranks.append(RankEnd(rank, fields.get("host", "?"), pid))
        elif event in ("end", "start-timeout"):
            known = next((r for r in self.ranks if (r.rank, r.pid) == (rank, pid)), None)
            if known is None:
                known = RankEnd(rank, fields.get("host", "?"), pid)
                self.ranks.append(known)
            if event == "start-timeout":
                known.gave_up_starting = self.cannot_start = True
                return
            try:
                known.code = int(fields.get("code", "1"))
            except ValueError:
                known.code = 1

    def left_running(self, pids, host):
        """Marks the ranks on `host` whose process is among `pids` (what the launcher
        left running when it exited) and that had not reported an end."""
        pids = {str(pid) for pid in pids}
        for end in self.ranks:
            if end.code is None and end.host == host and end.pid in pids:
                end.left_running = True

    def all_ended(self):
        """Whether every rank the job still counts on has reported its end: the ranks
        of its last world when it changed (an elastic job), else all of them."""
        latest = {}
        for end in self.ranks:
            latest[end.rank] = end
        wanted = self.world if self.world is not None else [str(r) for r in range(
            self.expected)]
        return all(r in latest and latest[r].code is not None for r in wanted)

    def exit_status(self, launcher_status, elastic=False):
        """The job's status: the launcher's when it failed; otherwise non-zero when a rank
        did not end cleanly. Under `elastic`, ranks that were lost (killed or vanished)
        are what the job survives: it fails only when a rank exited with an error, or no
        rank ended cleanly."""
        if launcher_status != 0:
            return launcher_status
        if self.cannot_start:
            return 1
        failed = [r for r in self.ranks if r.code not in (0, None) and r.code > 0]
        if elastic:
            if failed:
                return failed[0].code
            return 0 if any(r.clean() for r in self.ranks) else 1
        unclean = sorted((r for r in self.ranks if not r.clean()), key=_likely_cause)
        if unclean:
            code = unclean[0].code
            return 1 if code is None else (code if code > 0 else 128 - code)
        if len({r.rank for r in self.ranks}) < self.expected:
            return 1
        return 0

    def summary(self, verb, status, launcher_status):
        """One line: how each rank ended, grouped, and the status the job exits with."""
        groups = {}
        for end in self.ranks:
            groups.setdefault(end.how(), []).append(end.rank)
        started = {r.rank for r in self.ranks}
        missing = [str(r) for r in range(self.expected) if str(r) not in started]
        if missing:
            groups["never started (or its start line was lost)"] = missing
        parts = []
        # By the lowest rank of each group, not by the order ranks started in (which
        # host's ranks start first is chance), so that one job's line always reads alike.
        for how, ranks in sorted(groups.items(), key=lambda group: _lowest(group[1])):
            words = (dict(label="rank", its="its", it="it", was="was") if len(ranks) == 1
                     else dict(label="ranks", its="their", it="them", was="were"))
            parts.append(f"{words['label']} {_ranges(ranks)} {how.format(**words)}")
        said = "; ".join(parts) if parts else "no rank reported its start"
        launcher = "" if launcher_status == status else f" (the launcher exited {launcher_status})"
        return f"kdist {verb}: exit status {status}{launcher}: {said}."


# Signals a launcher sends to the ranks left when it ends a job: a consequence.
_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _likely_cause(end):
    """Orders unclean ends by how likely each caused the others: an error exit, then a
    rank killed (SIGKILL, SIGSEGV, ...), then a rank that vanished, then the ranks the
    launcher ended afterwards."""
    if end.code is None:
        return 3 if end.left_running else 2
    if end.code > 0:
        return 0
    return 3 if -end.code in [int(s) for s in _ENDING_SIGNALS] else 1


def _lowest(ranks):
    numbers = [int(r) for r in ranks if str(r).isdigit()]
    return (min(numbers), "") if numbers else (float("inf"), min(str(r) for r in ranks))


def _ranges(ranks):
    numbers = sorted({int(r) for r in ranks if str(r).isdigit()})
    others = sorted({str(r) for r in ranks if not str(r).isdigit()})
    spans, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            spans.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(spans + others)


def relay_records(fd, out, marker, on_record):
    """Copies the launcher's output from `fd` to the binary stream `out` as it comes,
    but for the lines that start with `marker`, which go to `on_record(text)`.

    A line of the wrapper's may come after another rank's unfinished line, so a marker
    is looked for anywhere; only a tail that could be the start of a marker is held back.
    Returns whether the output written ends a line (or nothing was written).
    """
    held = b""
    at_line_start = True
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data = held + chunk
        pieces = []
        while True:
            at = data.find(marker)
            if at < 0:
                keep = _partial_marker(data, marker)
                pieces.append(data[:len(data) - keep])
                held = data[len(data) - keep:]
                break
            end = data.find(b"\n", at)
            if end < 0:
                pieces.append(data[:at])
                held = data[at:]
                break
            pieces.append(data[:at])
            on_record(data[at + len(marker):end].decode(errors="replace").strip())
            data = data[end + 1:]
        text = b"".join(pieces)
        if text:
            out.write(text)
            out.flush()
            at_line_start = text.endswith(b"\n")
    if held:
        if held.startswith(marker):
            on_record(held[len(marker):].decode(errors="replace").strip())
        else:
            out.write(held)
            out.flush()
            at_line_start = held.endswith(b"\n")
    return at_line_start


def _partial_marker(data, marker):
    """How many bytes at the end of `data` are the beginning of `marker`."""
    for size in range(min(len(marker) - 1, len(data)), 0, -1):
        if marker.startswith(data[-size:]):
            return size
    return 0
