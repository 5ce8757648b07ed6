"""The kdist command line: run, info, docs."""

import io
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from kdist import cli


def kdist_cli(*args, timeout=120, text=True):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-m", "kdist.cli", *args], capture_output=True,
                          text=text, timeout=timeout, env=env)


def test_mpiexec_command_adds_what_the_machine_needs(mpiexec_path):
    argv, env = cli.mpiexec_command(64, ["python", "x.py"], mpiexec=mpiexec_path)
    assert argv[:3] == [mpiexec_path, "-n", "64"] and argv[-2:] == ["python", "x.py"]
    assert "--oversubscribe" in argv  # more ranks than cores
    with pytest.raises(ValueError, match="at least 1"):
        cli.mpiexec_command(0, ["true"], mpiexec=mpiexec_path)
    args = cli.build_parser().parse_args(["run", "-n", "2", "--mpi-args", "--bind-to none",
                                          "train.py", "--epochs", "3"])
    assert args.mpi_args == "--bind-to none" and args.command == ["train.py", "--epochs", "3"]


def test_oversubscribe_only_when_every_rank_runs_on_this_machine(mpiexec_path):
    for hosts in (["-H", "a:32,b:32"], ["--hostfile", "hosts.txt"], ["--host=a,b"]):
        argv, _ = cli.mpiexec_command(64, ["python", "x.py"], mpiexec=mpiexec_path,
                                      extra=hosts)
        assert "--oversubscribe" not in argv, hosts
        # A host lost from the network is noticed in seconds, not Open MPI's 8 minutes.
        assert argv[argv.index("oob_tcp_keepalive_time") + 1] == "10"
    argv, _ = cli.mpiexec_command(2, ["python", "x.py"], mpiexec=mpiexec_path)
    assert "oob_tcp_keepalive_time" not in argv  # one machine: nothing to lose
    # A job that survives losses keeps Open MPI's 8 minutes: noticing a lost daemon, this
    # launcher ends every rank, the survivors too.
    argv, _ = cli.mpiexec_command(4, ["python", "x.py"], mpiexec=mpiexec_path,
                                  extra=["-H", "a:2,b:2"], fault_tolerant=True)
    assert "oob_tcp_keepalive_time" not in argv
    assert cli.places_ranks_elsewhere([], {"SLURM_JOB_NUM_NODES": "4"})
    assert not cli.places_ranks_elsewhere(["--bind-to", "core"], {"SLURM_JOB_NUM_NODES": "1"})


def test_a_raw_command_is_resolved_where_kdist_run_is_called(tmp_path, monkeypatch):
    tool = tmp_path / "mytool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    args = cli.build_parser().parse_args(["run", "-n", "2", "--", "mytool", "--flag"])
    assert cli._user_command(args, "run") == [str(tool), "--flag"]
    args = cli.build_parser().parse_args(["run", "-n", "2", "--", "no-such-tool-here"])
    assert cli._user_command(args, "run") == ["no-such-tool-here"]  # the launcher says why


def test_run_passes_every_kdist_setting_on_to_ranks_on_other_nodes(monkeypatch):
    monkeypatch.setenv("KDIST_BUCKET_BYTES", "4096")
    monkeypatch.setenv("KDIST_RING", "0")
    forwarded = cli._forwarded(verbose=False)
    assert forwarded[0] == "KDIST_TTY" and "KDIST_VERBOSE" not in forwarded
    assert {"KDIST_BUCKET_BYTES", "KDIST_RING"} <= set(forwarded)
    monkeypatch.setenv("KDIST_TF_HOST", "this-host")  # names this host: not passed on
    assert "KDIST_TF_HOST" not in cli._forwarded(verbose=False)
    assert "KDIST_VERBOSE" in cli._forwarded(verbose=True)


def test_the_launcher_is_told_from_its_environment():
    assert cli.launcher_name({"OMPI_COMM_WORLD_RANK": "0", "SLURM_STEP_ID": "0"}) == \
        "mpiexec (Open MPI)"
    assert cli.launcher_name({"SLURM_STEP_ID": "0", "PMIX_RANK": "1"}) == "srun"
    assert cli.launcher_name({"SLURM_STEP_ID": "0", "PMI_FD": "5", "PMI_RANK": "1"}) == "srun"
    assert cli.launcher_name({"HYDI_CONTROL_FD": "7", "PMI_FD": "5", "PMI_RANK": "1"}) == \
        "mpiexec (Hydra)"
    assert cli.launcher_name({}) == "none"


def test_fault_tolerant_runs_turn_on_open_mpi_ulfm_with_a_quick_detector(mpiexec_path):
    argv, _ = cli.mpiexec_command(2, ["python", "x.py"], mpiexec=mpiexec_path,
                                  fault_tolerant=True)
    assert argv[argv.index("--with-ft") + 1] == "ulfm"
    assert "mpi_ft_detector_timeout" in argv and argv[-2:] == ["python", "x.py"]
    args = cli.build_parser().parse_args(["run", "--fault-tolerant", "-n", "3", "train.py"])
    assert args.fault_tolerant and args.command == ["train.py"]
    with pytest.raises(ValueError, match="ULFM"):
        cli.mpiexec_command(2, ["true"], mpiexec="/opt/mpich/bin/mpiexec.hydra",
                            fault_tolerant=True)


def test_the_supported_versions_are_pyprojects_and_others_are_named():
    import pathlib
    import tomllib

    from kdist import _support

    project = tomllib.loads((pathlib.Path(__file__).parent.parent / "pyproject.toml")
                            .read_text())["project"]
    declared = {line.split(">")[0].split("<")[0].strip(): line for line in
                project["dependencies"]}
    ranges = _support.supported()
    assert set(ranges) == {"tensorflow", "keras"}
    for name, wanted in ranges.items():
        # The installed metadata says what pyproject says (a stale install would not).
        assert declared[name] == name + wanted, (declared[name], wanted)
    low = ranges["tensorflow"].split(",")[0].lstrip(">=")
    older = f"{low.split('.')[0]}.{int(low.split('.')[1]) - 1}.0"
    assert _support.outside({"tensorflow": older, "keras": "3.99.0"}) == [
        ("tensorflow", older, ranges["tensorflow"])]


def test_info_reports_versions_and_ranks():
    done = kdist_cli("info", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["size"] == 1 and info["rank"] == 0
    assert info["tensorflow"] and info["keras"].startswith("3.")
    assert info["strategy"].startswith("default (one process")
    assert set(info["supported"]) == {"tensorflow", "keras"} and info["unsupported"] == []


@pytest.mark.mpi
def test_run_prefixes_each_rank_and_reports_info(mpiexec_path):
    done = kdist_cli("run", "-n", "2", "--", sys.executable, "-m", "kdist.cli", "info")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[0] " not in done.stdout  # rank 0 reports for all, untagged
    assert "size: 2" in done.stdout and "rank 1:" in done.stdout
    assert "strategy: mpi (started by an MPI launcher with 2 tasks)" in done.stdout


@pytest.mark.mpi
def test_run_fails_when_any_rank_fails(mpiexec_path, tmp_path):
    script = tmp_path / "fail_on_one.py"
    # Rank 1 fails only after rank 0 has finished, so that both outputs are complete.
    script.write_text("import os, sys, time\n"
                      "rank = int(os.environ.get('OMPI_COMM_WORLD_RANK', 0))\n"
                      "print('hello from', rank)\n"
                      "time.sleep(2 if rank == 1 else 0)\n"
                      "sys.exit(3 if rank == 1 else 0)\n")
    done = kdist_cli("run", "-n", "2", str(script))
    assert done.returncode == 3
    lines = done.stdout.splitlines()
    assert "hello from 0" in lines and "[1] hello from 1" in lines
    # The wrappers' start and end lines are not in the output; the last line says how
    # each rank ended.
    assert "kdist-run:" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kdist run: exit status 3") and "rank 0 ended cleanly" in last
    assert "rank 1 exited with status 3 on host" in last


def _relayed(chunks, marker=b"\x1ekdist-run:t:"):
    """What relay_records writes and the records it finds, `chunks` read one by one."""
    from kdist import _rank_ends

    read, write = os.pipe()
    records, out = [], io.BytesIO()

    def feed():
        # A pause between writes, so that each chunk is most likely a read of its own.
        for chunk in chunks:
            os.write(write, chunk)
            time.sleep(0.02)
        os.close(write)

    feeder = threading.Thread(target=feed)
    feeder.start()
    _rank_ends.relay_records(read, out, marker, records.append)
    feeder.join()
    os.close(read)
    return out.getvalue(), records


def test_run_takes_the_wrappers_lines_out_of_the_output_wherever_reads_cut_them():
    m = b"\x1ekdist-run:t:"
    text, records = _relayed([b"epoch 1/3\r", b"[1] half a li", m[:5], m[5:] + b"start rank=1",
                              b" host=b pid=7\nne\n", m + b"end rank=1 host=b pid=7 code=0\n",
                              b"\x1ekd", b"not a marker\n"])
    assert text == b"epoch 1/3\r[1] half a line\n\x1ekdnot a marker\n"
    assert records == ["start rank=1 host=b pid=7", "end rank=1 host=b pid=7 code=0"]


def test_a_rank_that_never_reports_its_end_fails_the_run_whatever_the_launcher_says():
    from kdist._rank_ends import Ends

    ends = Ends(3)
    for rank, host in ((0, "a"), (1, "a"), (2, "b")):
        ends.add(f"start rank={rank} host={host} pid=1{rank}")
    ends.add("end rank=0 host=a pid=10 code=0")
    ends.add("end rank=1 host=a pid=11 code=-15")
    # The launcher lost host b's daemon and still exited 0.
    assert ends.exit_status(0) == 1
    line = ends.summary("run", 1, 0)
    assert line.startswith("kdist run: exit status 1 (the launcher exited 0): ")
    assert "rank 0 ended cleanly" in line and "rank 1 was killed by SIGTERM on host a" in line
    assert "rank 2 never reported its end (host b" in line
    # The launcher's own failure wins; a rank that never started fails the run too.
    assert ends.exit_status(7) == 7
    partial = Ends(2)
    partial.add("start rank=0 host=a pid=1")
    partial.add("end rank=0 host=a pid=1 code=0")
    assert partial.exit_status(0) == 1
    assert "rank 1 never started" in partial.summary("run", 1, 0)
    everyone = Ends(2)
    for rank in (0, 1):
        everyone.add(f"start rank={rank} host=a pid={rank}")
        everyone.add(f"end rank={rank} host=a pid={rank} code=0")
    assert everyone.exit_status(0) == 0
    assert everyone.summary("run", 0, 0) == "kdist run: exit status 0: ranks 0-1 ended cleanly."


def test_an_elastic_run_survives_lost_ranks_but_not_a_rank_that_failed():
    from kdist._rank_ends import Ends

    ends = Ends(3)
    for rank in range(3):
        ends.add(f"start rank={rank} host=h pid={rank}")
    ends.add("end rank=0 host=h pid=0 code=0")
    ends.add("end rank=1 host=h pid=1 code=-9")  # lost, rank 2 vanished with its host
    assert ends.exit_status(0, elastic=True) == 0
    assert ends.exit_status(0) == 128 + 9  # the kill, more likely the cause than the loss
    ends.add("start rank=3 host=h pid=9")  # a replacement that then failed
    ends.add("end rank=3 host=h pid=9 code=2")
    assert ends.exit_status(0, elastic=True) == 2
    nobody = Ends(1)
    nobody.add("start rank=0 host=h pid=0")
    assert nobody.exit_status(0, elastic=True) == 1


def test_what_a_launcher_leaves_running_is_ended_with_it(tmp_path):
    # A launcher that gives up on a lost host may exit and leave that host's remote shell
    # (or one of its own ranks) running, holding kdist run's output open: a `kdist run |
    # tee` would wait for it. Here the "launcher" leaves a process of its own session
    # behind, outside its process group, and exits.
    pid_file = tmp_path / "left.pid"
    launcher = ["sh", "-c", f"setsid sleep 600 & echo $! > {pid_file}; exit 0"]
    code = ("import os, sys; from kdist import cli; "
            f"sys.exit(cli._run_and_report({launcher!r}, dict(os.environ), 1, False, 'run'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    left = int(pid_file.read_text())
    assert not os.path.exists(f"/proc/{left}") or "Z" in open(f"/proc/{left}/stat").read()
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "rank 0 never started" in last, done.stderr
    assert "The launcher left 1 process(es) running (" in last  # named as it was then
    assert last.endswith("); kdist run ended them.")


def test_kdist_run_tells_its_own_clocks_from_what_a_launcher_left(tmp_path):
    # A rank's clock (kdist/comm/_clock.py) may outlive it by a moment; kdist run ends it
    # without counting it among what the launcher left behind.
    from kdist import _left_behind
    from kdist.comm import _clock

    clock = subprocess.Popen([sys.executable, "-I", os.path.relpath(_clock.__file__),
                              "--parent", str(os.getpid()), "--after", "60"])
    other = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + 30
        while not _left_behind.is_kdist_clock(clock.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the interpreter has started
        assert _left_behind.is_kdist_clock(clock.pid)
        assert not _left_behind.is_kdist_clock(other.pid)
        _left_behind.end([clock.pid, other.pid])
        assert clock.wait(10) is not None and other.wait(10) is not None
    finally:
        for process in (clock, other):
            process.kill()
            process.wait()


def test_a_job_line_names_its_ranks_in_order_whatever_order_they_started_in():
    from kdist._rank_ends import Ends

    ends = Ends(4)
    for rank in (2, 3, 0, 1):  # the other host's ranks started first
        ends.add(f"start rank={rank} host=h{rank // 2} pid={rank}")
    for rank in (0, 1):
        ends.add(f"end rank={rank} host=h0 pid={rank} code=0")
    assert ends.summary("run", 0, 0).startswith(
        "kdist run: exit status 0: ranks 0-1 ended cleanly; ranks 2-3 never reported their "
        "end (host h1")
    # A launcher that gave up on host h1 exited and left rank 0 running on this host.
    lost = Ends(2)
    lost.add("start rank=0 host=h0 pid=5")
    lost.add("start rank=1 host=h1 pid=5")
    lost.left_running([5, 6], "h0")
    assert lost.exit_status(0) == 1
    assert lost.summary("run", 1, 0) == (
        "kdist run: exit status 1 (the launcher exited 0): rank 0 was left running by the "
        "launcher on host h0 (kdist run ended it); rank 1 never reported its end (host h1: "
        "lost, or the rank was killed with its wrapper).")


def test_the_job_has_ended_once_the_ranks_it_goes_on_with_have_ended():
    # kdist run ends a launcher that outlives these by LAUNCHER_GRACE (it waits for a
    # lost host): tests/test_hosts.py takes a host off the network for the whole story.
    from kdist._rank_ends import Ends

    ends = Ends(4)
    for rank in range(4):
        ends.add(f"start rank={rank} host=h{rank // 2} pid={rank}")
    assert not ends.all_ended()
    ends.add("world ranks=0,1")  # an elastic job that lost host h1
    ends.add("end rank=0 host=h0 pid=0 code=0")
    assert not ends.all_ended()
    ends.add("end rank=1 host=h0 pid=1 code=0")
    assert ends.all_ended()
    ends.add("world ranks=0,1,2")  # a replacement joins: it counts too
    assert not ends.all_ended()
    plain = Ends(2)
    plain.add("start rank=0 host=h pid=0")
    plain.add("end rank=0 host=h pid=0 code=0")
    assert not plain.all_ended()  # rank 1 never even started
    plain.add("start rank=1 host=h pid=1")
    plain.add("end rank=1 host=h pid=1 code=3")
    assert plain.all_ended()


def test_a_rank_that_gave_up_starting_fails_even_an_elastic_run(monkeypatch):
    # Its start-up clock (kdist.comm.processes._StartDeadline) writes the record from a
    # process of its own, then kills the rank; a fault-tolerant launcher would wait for
    # the ranks that never started, so kdist run ends it at once.
    from kdist import _prefix
    from kdist._rank_ends import Ends

    monkeypatch.setenv(_prefix.TOKEN_VARIABLE, "t0k")
    line = _prefix.record_text("start-timeout", rank=0, host="h0", pid=5)
    assert line.encode().startswith(_prefix.record_marker("t0k"))
    ends = Ends(2)
    ends.add("start rank=0 host=h0 pid=5")
    ends.add("start rank=1 host=h1 pid=6")
    assert not ends.cannot_start
    ends.add(line[len(_prefix.record_marker("t0k")):])
    ends.add("end rank=0 host=h0 pid=5 code=-9")
    assert ends.cannot_start and not ends.all_ended()
    assert ends.exit_status(0, elastic=True) == 1
    summary = ends.summary("run", 1, 0)
    assert "rank 0 gave up waiting for the others to start (KDIST_START_TIMEOUT) on host h0" \
        in summary
    assert "rank 1 never reported its end" in summary
    monkeypatch.delenv(_prefix.TOKEN_VARIABLE)
    assert _prefix.record_text("start-timeout", rank=0) == ""


def test_a_ranks_own_record_reaches_kdist_run_untagged():
    import io

    from kdist._prefix import record_marker, relay

    marker = record_marker("t0k")
    read, write = os.pipe()
    os.write(write, b"hello\n" + marker + b"world ranks=0,1\nbye\n")
    os.close(write)
    out = io.BytesIO()
    relay(read, b"[1] ", out, untagged=marker)
    os.close(read)
    assert out.getvalue() == b"[1] hello\n" + marker + b"world ranks=0,1\n[1] bye\n"


def test_run_explains_a_missing_script():
    done = kdist_cli("run", "-n", "2", "no_such_script.py")
    assert done.returncode != 0 and "no such script" in done.stderr
    done = kdist_cli("run", "-n", "2")
    assert done.returncode != 0 and "give a script" in done.stderr


def _rank(rank, host="a", cores=2, core_set=(0, 1), threads=1):
    return {"rank": rank, "host": host, "cores_on_node": cores, "core_set": list(core_set),
            "cores_allowed": len(core_set), "intra_op_threads": threads}


def test_info_says_when_ranks_share_cores_or_are_unbound():
    from kdist.cli import placement_advice

    bound = [_rank(0, core_set=[0]), _rank(1, core_set=[1])]
    assert placement_advice(bound) == []
    unbound = [_rank(0), _rank(1)]
    assert any("not bound to cores" in line for line in placement_advice(unbound))
    crowded = [_rank(r, core_set=[r % 2]) for r in range(4)]
    advice = placement_advice(crowded)
    assert any("4 ranks share the 2 core(s) of a" in line for line in advice)
    assert any("overlapping cores" in line for line in advice)
    threaded = [_rank(0, core_set=[0], threads=2), _rank(1, core_set=[1], threads=2)]
    assert any("rank 0 runs 2 intra-op thread(s)" in line
               for line in placement_advice(threaded))
    # The binding hint speaks the launcher's language.
    hints = {launcher: next(line for line in placement_advice(
        [dict(r, launcher=launcher) for r in unbound]) if "not bound" in line)
        for launcher in ("srun", "mpiexec (Hydra)", "mpiexec (Open MPI)")}
    assert "--cpu-bind=cores" in hints["srun"]
    assert '"-bind-to core"' in hints["mpiexec (Hydra)"]
    assert '"--bind-to core"' in hints["mpiexec (Open MPI)"]
    # Two hosts of two cores each, a rank per core: nothing to say.
    spread = [_rank(0, "a", core_set=[0]), _rank(1, "a", core_set=[1]),
              _rank(2, "b", core_set=[0]), _rank(3, "b", core_set=[1])]
    assert placement_advice(spread) == []


def test_run_warns_when_ranks_outnumber_cores(mpiexec_path):
    n = (os.cpu_count() or 1) + 1
    done = kdist_cli("run", "-n", str(n), "--", sys.executable, "-c", "pass")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{n} ranks on {os.cpu_count()} core(s): ranks share cores" in done.stderr


def test_relay_drops_tensorflow_start_up_lines_and_tags_a_redrawn_bar_once():
    from kdist import _prefix

    said = (b"WARNING: All log messages before absl::InitializeLog() is called are written to "
            b"STDERR\n"
            b"I0000 00:00:1795588120.353580   32358 port.cc:153] oneDNN custom operations are "
            b"on. You may see slightly different numerical results.\n"
            b"E0000 00:00:1795591094.708489   13672 cuda_platform.cc:52] failed call to cuInit: "
            b"INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n"
            b"E0000 00:00:1795588120.354005   32359 cuda_dnn.cc:8] a real error\n"
            b"Epoch 1/2\n\r 1/9 loss\x08\x08\x08\r 2/9 loss\n")
    read, write = os.pipe()
    os.write(write, said)
    os.close(write)
    out = __import__("io").BytesIO()
    _prefix.relay(read, b"[1] ", out, drop=_prefix.START_UP_NOISE)
    os.close(read)
    assert out.getvalue() == (b"[1] E0000 00:00:1795588120.354005   32359 cuda_dnn.cc:8] a real "
                              b"error\n[1] Epoch 1/2\n\r[1]  1/9 loss\x08\x08\x08\r[1]  2/9 loss\n")


@pytest.mark.mpi
def test_run_hides_tensorflow_start_up_lines_unless_verbose(mpiexec_path, tmp_path):
    script = tmp_path / "tf_hello.py"
    script.write_text("import tensorflow as tf\nprint('ready', tf.constant(1).numpy())\n")
    quiet, loud = kdist_cli("run", "-n", "2", str(script)), kdist_cli("run", "-v", "-n", "2",
                                                                       str(script))
    assert quiet.returncode == loud.returncode == 0, quiet.stdout + loud.stdout
    assert "ready 1" in quiet.stdout.splitlines() and "[1] ready 1" in quiet.stdout
    assert "absl::InitializeLog" not in quiet.stdout and "port.cc" not in quiet.stdout
    assert "absl::InitializeLog" in loud.stdout


@pytest.mark.mpi
def test_run_passes_rank_0_through_and_keeps_colours_only_on_a_terminal(mpiexec_path, tmp_path):
    script = tmp_path / "bar.py"
    script.write_text("import os, sys\n"
                      "rank = os.environ['OMPI_COMM_WORLD_RANK']\n"
                      "bold, plain = '\\x1b[1m', '\\x1b[0m'\n"
                      "sys.stdout.write(f'{bold}{rank}/2{plain}\\r{bold}2/2{plain} done\\n')\n")
    # Bytes: text mode would turn the carriage returns into newlines.
    piped = kdist_cli("run", "-n", "2", str(script), text=False)
    assert piped.returncode == 0, piped.stdout + piped.stderr
    assert b"\x1b[" not in piped.stdout  # a log gets plain text
    assert b"0/2\r2/2 done\n" in piped.stdout and b"[1] 1/2\r[1] 2/2 done\n" in piped.stdout
    assert b"[0]" not in piped.stdout

    import pty

    leader, follower = pty.openpty()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    job = subprocess.Popen([sys.executable, "-m", "kdist.cli", "run", "-n", "2", str(script)],
                           stdout=follower, stderr=subprocess.DEVNULL, env=env)
    os.close(follower)
    seen = b""
    try:
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closes with the job
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(leader)
        assert job.wait(timeout=60) == 0, seen
    assert b"\x1b[1m0/2\x1b[0m\r" in seen and b"[1] \x1b[1m1/2" in seen


def test_docs_builds_the_site_and_says_where_to_open_it(tmp_path):
    if cli._docs_tools_missing():
        pytest.skip("the docs extra (mkdocs-material, mkdocstrings[python]) is not installed")
    site = tmp_path / "site"
    done = kdist_cli("docs", "--site-dir", str(site), timeout=180)
    assert done.returncode == 0, done.stderr
    assert (site / "index.html").is_file() and (site / "reference" / "callbacks").is_dir()
    assert str(site / "index.html") in done.stdout


def test_docs_without_mkdocs_says_which_extra_to_install(monkeypatch):
    monkeypatch.setattr(cli, "_docs_tools_missing", lambda: ["mkdocs"])
    with pytest.raises(SystemExit, match=r'pip install "kdist\[docs\]"'):
        cli.main(["docs"])


def test_the_rank_wrapper_passes_on_descriptors_the_launcher_handed_down():
    # MPICH's Hydra (and srun's PMI-2) give each rank its PMI socket as an inherited
    # descriptor named in PMI_FD; the rank must still have it behind kdist's wrapper.
    from kdist import _prefix

    read, write = os.pipe()
    os.set_inheritable(write, True)
    try:
        probe = "import os; os.fstat(int(os.environ['PMI_FD'])); print('descriptor open')"
        done = subprocess.run([sys.executable, _prefix.__file__, "--", sys.executable, "-c",
                               probe], env=dict(os.environ, PMI_FD=str(write)),
                              capture_output=True, text=True, timeout=60, pass_fds=(write,))
    finally:
        os.close(read)
        os.close(write)
    assert done.returncode == 0 and "descriptor open" in done.stdout, done.stdout


AVX2_ONLY = {"sse4_1", "avx", "avx2", "fma"}  # an AMD EPYC Rome or Milan, as /proc/cpuinfo lists


def test_onednn_is_turned_on_only_where_tensorflow_leaves_it_off_and_nobody_chose():
    from kdist.comm import onednn

    linux = {"machine": "x86_64", "system": "Linux"}
    epyc = onednn.decide(AVX2_ONLY, {}, **linux)
    assert epyc["default"] is False and epyc["turn_on"] is True
    assert "TF_ENABLE_ONEDNN_OPTS=1" in epyc["why"]
    cascade_lake = onednn.decide(AVX2_ONLY | {"avx512f", "avx512_vnni"}, {}, **linux)
    assert cascade_lake["default"] is True and cascade_lake["turn_on"] is False
    assert "avx512_vnni" in cascade_lake["why"]
    # The user's choice, either way, and kdist's switch are left alone.
    for environ in ({"TF_ENABLE_ONEDNN_OPTS": "0"}, {"TF_ENABLE_ONEDNN_OPTS": "1"},
                    {"KDIST_ONEDNN": "0"}):
        assert onednn.decide(AVX2_ONLY, environ, **linux)["turn_on"] is False
    old = onednn.decide({"sse4_1", "avx"}, {}, **linux)
    assert old["turn_on"] is False and "neither AVX2" in old["why"]
    assert onednn.decide(set(), {}, **linux)["turn_on"] is False
    arm = onednn.decide({"asimd"}, {}, machine="aarch64", system="Linux")
    assert arm["default"] is None and arm["turn_on"] is False
    assert onednn.environment_for_ranks({}, AVX2_ONLY) == {"TF_ENABLE_ONEDNN_OPTS": "1"}
    assert onednn.environment_for_ranks({"KDIST_ONEDNN": "0"}, AVX2_ONLY) == {}


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    from kdist.comm import onednn

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse4_1 avx2\n\nprocessor\t: 1\n")
    assert onednn.cpu_flags(cpuinfo) == {"fpu", "sse4_1", "avx2"}
    assert onednn.cpu_flags(tmp_path / "missing") == set()


@pytest.mark.mpi
def test_run_gives_its_ranks_onednn_on_a_cpu_where_tensorflow_leaves_it_off(
        mpiexec_path, monkeypatch, capfd):
    from kdist.comm import onednn

    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    monkeypatch.delenv("KDIST_ONEDNN", raising=False)
    monkeypatch.setattr(onednn, "cpu_flags", lambda path="": AVX2_ONLY)
    monkeypatch.setattr(onednn.platform, "machine", lambda: "x86_64")
    show = [sys.executable, "-c",
            "import os; print('setting', os.environ.get('TF_ENABLE_ONEDNN_OPTS'))"]
    assert cli.main(["run", "-n", "1", "--verbose", "--", *show]) == 0
    out, err = capfd.readouterr()
    assert "setting 1" in out and "TF_ENABLE_ONEDNN_OPTS=1 for the ranks" in err
    assert "-x TF_ENABLE_ONEDNN_OPTS" in err  # passed on to ranks on other hosts too
    monkeypatch.setenv("KDIST_ONEDNN", "0")
    assert cli.main(["run", "-n", "1", "--", *show]) == 0
    assert "setting None" in capfd.readouterr().out


def test_info_says_which_cpu_kernels_the_ranks_run_and_how_to_change_it():
    from kdist.cli import kernel_advice

    off = "the CPU has avx2 but none of ...: TensorFlow leaves oneDNN off unless " \
          "TF_ENABLE_ONEDNN_OPTS=1"
    ranks = [dict(_rank(r), onednn=False, onednn_why=off) for r in range(2)]
    (line,) = kernel_advice(ranks)
    assert line.startswith("CPU kernels on every rank: TensorFlow's own")
    assert "Set TF_ENABLE_ONEDNN_OPTS=1 before the script starts" in line
    mixed = [dict(ranks[0], onednn=True, onednn_why="the CPU has avx512_vnni: ..."), ranks[1]]
    lines = kernel_advice(mixed)
    assert len(lines) == 2 and any("ranks [0]: oneDNN's" in each for each in lines)
    done = kdist_cli("info")
    assert done.returncode == 0, done.stderr
    from kdist.comm import onednn

    setting = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
    on = onednn.decide(onednn.cpu_flags())["default"] if setting is None else setting == "1"
    expected = "oneDNN's" if on else "TensorFlow's"
    assert f"CPU kernels on every rank: {expected}" in done.stdout
