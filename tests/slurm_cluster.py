"""A one-node SLURM cluster on loopback, for tests of kdist under srun and sbatch.

`LocalSlurm(directory)` writes a `slurm.conf` for this machine (its cores, 127.0.0.1,
ports of its own), starts munge, slurmctld and slurmd as root with their state, logs and
munge socket in `directory`, and stops them on exit. Clients find the cluster through
`SLURM_CONF`, which `env()` sets: without it Slurm's clients look for the controller in
DNS records, off this machine. Debian's packages `slurm-wlm`, `munge` and `libpmix-dev`
(the last one for srun's pmix plugin) provide the programs; `available()` says what is
missing.
"""

import os
import shutil
import socket
import subprocess
import time

PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "squeue")
INSTALL = "apt-get install slurm-wlm munge libpmix-dev"


def available():
    """None when a local cluster can be started here, else why not."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"Slurm is not installed (no {', '.join(missing)}): {INSTALL}"
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd starts jobs as their users)"
    if not os.path.exists("/etc/munge/munge.key"):
        return f"munge has no key (/etc/munge/munge.key): reinstall munge ({INSTALL})"
    return None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    """A controller and one compute node, this machine, under the name it gives itself."""

    def __init__(self, directory, cores=None):
        self.dir = os.path.abspath(directory)
        self.node = socket.gethostname()
        self.cores = cores or os.cpu_count()
        self.conf = os.path.join(self.dir, "slurm.conf")
        self._daemons = []

    def env(self, base=None):
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.conf
        return env

    def _write_config(self):
        for sub in ("state", "spool", "log"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        d = self.dir
        lines = [
            "ClusterName=kdisttest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={d}/munge.sock",
            "CredType=cred/munge",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd.log",
            # No cgroups in a container: track processes by their parents.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/builtin",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cores} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=YES",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _start(self, argv):
        log = open(os.path.join(self.dir, "log", os.path.basename(argv[0]) + ".out"), "w")
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   env=self.env(), start_new_session=True)
        self._daemons.append((process, log))

    def __enter__(self):
        why_not = available()
        if why_not:
            raise RuntimeError(why_not)
        self._write_config()
        d = self.dir
        self._start([shutil.which("munged"), "--foreground", "--force",
                     f"--socket={d}/munge.sock", f"--pid-file={d}/munged.pid",
                     f"--log-file={d}/log/munged.log", f"--seed-file={d}/munge.seed"])
        deadline = time.monotonic() + 20
        while not os.path.exists(f"{d}/munge.sock"):
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"munged did not start: {self.log('munged.log')}")
            time.sleep(0.1)
        self._start([shutil.which("slurmctld"), "-D", "-f", self.conf])
        self._start([shutil.which("slurmd"), "-D", "-f", self.conf])
        self.wait_until_idle(60)
        return self

    def wait_until_idle(self, timeout):
        """Waits until the node takes jobs; RuntimeError with the daemons' logs if not."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            done = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env(),
                                  capture_output=True, text=True, timeout=30)
            state = done.stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm node is '{state}', not idle, after {timeout} s:\n"
                           f"{self.log('slurmctld.log')}\n{self.log('slurmd.log')}")

    def log(self, name, tail=3000):
        path = os.path.join(self.dir, "log", name)
        if not os.path.exists(path):
            return f"({name}: none)"
        with open(path, errors="replace") as f:
            return f.read()[-tail:]

    def sbatch(self, script, timeout=300, env=None):
        """Submits `script` (its text), waits for it, and returns (exit code, output)."""
        path = os.path.join(self.dir, f"job_{abs(hash(script))}.sh")
        with open(path, "w") as f:
            f.write(script)
        output = path + ".out"
        done = subprocess.run(["sbatch", "--wait", f"--output={output}", path],
                              env=self.env(env), capture_output=True, text=True,
                              timeout=timeout)
        text = open(output, errors="replace").read() if os.path.exists(output) else ""
        return done.returncode, text + done.stderr

    def __exit__(self, *exc):
        # scancel first: a job left running would outlive its daemons.
        subprocess.run(["scancel", "--full", "--partition=debug"], env=self.env(),
                       capture_output=True, timeout=30)
        for process, log in reversed(self._daemons):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            log.close()
        self._daemons = []
        return False
