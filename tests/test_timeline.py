"""The timeline: every collective of every rank, in one Chrome-trace file."""

import json
import os

import pytest

import kdist

GRAPH, PYTHON = 1, 0


def _spans(events, rank, track, name=None):
    return [e for e in events if e.get("ph") == "X" and e["pid"] == rank and e["tid"] == track
            and (name is None or e["name"] == name)]


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["env", "api"])
def test_every_rank_s_collectives_are_merged_into_one_trace(mpirun, tmp_path, mode):
    path = tmp_path / "timeline.json"
    env = {"KDIST_TIMELINE": str(path)} if mode == "env" else {}
    job = mpirun("timeline.py", n=2, args=[mode, path], env=env, timeout=240)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".part")]
    assert path.exists(), os.listdir(tmp_path)
    if mode == "api":
        assert job.rank(0)["written"] == str(path)
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {"rank 0", "rank 1"}
    gradient_bytes = 4 * job.rank(0)["parameters"]
    for rank in (0, 1):
        # 24 samples in batches of 8: three fused gradient reductions per rank.
        packs = _spans(events, rank, GRAPH, "pack")
        assert len(packs) == 3 and all(p["args"]["bytes"] == gradient_bytes for p in packs)
        assert len(_spans(events, rank, GRAPH, "negotiate")) >= 3
        assert len(_spans(events, rank, GRAPH, "allreduce")) >= 3
        probe = [e for e in _spans(events, rank, PYTHON, "allreduce")
                 if "probe" in e["args"]["what"]]
        # Five float64 values and the count of ranks that contributed.
        assert len(probe) == 1 and probe[0]["args"]["bytes"] == 6 * 8
        cycles = [e for e in events if e.get("name") == "cycle" and e["pid"] == rank]
        assert len(cycles) == (3 if mode == "api" else 0)
        for span in _spans(events, rank, GRAPH) + _spans(events, rank, PYTHON):
            assert span["ts"] >= 0 and span["dur"] >= 0
    # Rank 1 came to the probe a second after the line-up: rank 0 waited in the negotiation.
    negotiations = [e for e in _spans(events, 0, PYTHON, "negotiate")
                    if "probe" in e["args"]["what"]]
    assert len(negotiations) == 1 and negotiations[0]["dur"] >= 3e5


def test_a_timeline_needs_a_writable_directory_and_one_at_a_time(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        kdist.start_timeline(tmp_path / "missing" / "t.json")
    kdist.start_timeline(tmp_path / "t.json")
    try:
        with pytest.raises(RuntimeError, match="already records"):
            kdist.start_timeline(tmp_path / "u.json")
    finally:
        written = kdist.stop_timeline()
    assert written == str(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["otherData"]["ranks"] == 1
    assert kdist.stop_timeline() is None
