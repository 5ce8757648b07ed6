"""Several hosts on this machine: network namespaces joined by a switch, for MPI jobs.

Each host `h0`, `h1`, ... is a network namespace with one interface on a
link-local subnet (169.254.N.0/24), plugged into a bridge that lives in a
namespace of its own, so no traffic touches this machine's own interfaces and
nothing routes out. Ranks are started as on a cluster: `mpiexec` runs "on"
h0, and Open MPI's remote-shell agent (an `ssh` stand-in that runs the command
with `ip netns exec` in the host's namespace, under its own host name) starts
the daemons of the other hosts. The only path between hosts is TCP over the
bridge; ranks on one host share memory as usual.

Needs root, `ip` and `unshare`; `available()` says why not otherwise.
"""

import os
import shlex
import shutil
import subprocess
import tempfile


def available():
    """None when hosts can be emulated here, else why not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "emulating hosts needs root (network namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"emulating hosts needs the `{tool}` command"
    return None


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


class EmulatedHosts:
    """`count` hosts; use as a context manager, which removes everything it made."""

    def __init__(self, count):
        if not 2 <= count <= 8:
            raise ValueError(f"count must lie between 2 and 8; got {count}.")
        self.count = count
        tag = os.getpid() % 100000
        self.prefix = f"kd{tag}"
        self.subnet_id = tag % 250 + 2
        self.subnet = f"169.254.{self.subnet_id}.0/24"
        self.names = [f"h{i}" for i in range(count)]
        self._directory = None

    def namespace(self, host):
        return f"{self.prefix}{host}"

    def address(self, index):
        return f"169.254.{self.subnet_id}.{index + 1}"

    def __enter__(self):
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _create(self):
        self._directory = tempfile.mkdtemp(prefix="kdist-hosts-")
        switch = f"{self.prefix}sw"
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{self.address(i)} {name}\n" for i, name in enumerate(self.names))
        for i, name in enumerate(self.names):
            namespace = self.namespace(name)
            _ip("netns", "add", namespace)
            # `ip netns exec` shows this file as the namespace's /etc/hosts.
            etc = f"/etc/netns/{namespace}"
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(hosts_file)
            inside, outside = f"{self.prefix}e{i}", f"{self.prefix}p{i}"
            _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            _ip("link", "set", inside, "netns", namespace)
            _ip("link", "set", outside, "netns", switch)
            _ip("-n", switch, "link", "set", outside, "master", "br0")
            _ip("-n", switch, "link", "set", outside, "up")
            _ip("-n", namespace, "addr", "add", f"{self.address(i)}/24", "dev", inside)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "link", "set", inside, "up")
        self.agent = os.path.join(self._directory, "agent.sh")
        with open(self.agent, "w") as f:
            f.write("#!/bin/sh\n"
                    "# Open MPI's remote-shell agent: runs the command on host $1.\n"
                    "host=$1; shift\n"
                    f'exec ip netns exec "{self.prefix}$host" unshare --uts '
                    'sh -c "hostname $host; $*"\n')
        os.chmod(self.agent, 0o755)

    def close(self):
        """Ends what still runs on the hosts (a daemon whose link went down outlives its
        job), then removes the namespaces (their interfaces go with them) and the files."""
        self.kill_processes()
        for name in self.names + ["sw"]:
            namespace = self.namespace(name) if name != "sw" else f"{self.prefix}sw"
            _ip("netns", "delete", namespace, check=False)
            shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)
        if self._directory:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None

    def kill_processes(self):
        """Kills whatever runs on the hosts: a launcher's daemon on a host whose link went
        down outlives its job, and holds the job's output open."""
        for name in self.names + ["sw"]:
            namespace = self.namespace(name) if name != "sw" else f"{self.prefix}sw"
            for pid in _ip("netns", "pids", namespace, check=False).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (OSError, ValueError):
                    pass

    def set_link(self, host, up):
        """Plugs host `host` (an index) into the switch, or pulls its cable."""
        state = "up" if up else "down"
        _ip("-n", f"{self.prefix}sw", "link", "set", f"{self.prefix}p{host}", state)

    def limit_link(self, host, gbit, burst=None):
        """Limits what host `host` (an index) sends to `gbit` Gbit/s with tc's token bucket
        filter on its side of the veth; `burst` is the bucket (bytes, or a size as tc reads
        it: "1mbit"), by default what the rate carries in 1 ms (at least 64 KiB). A falsy
        `gbit` leaves the link as it is."""
        if not gbit:
            return
        if burst is None:
            burst = max(int(gbit * 1e9 / 8 * 1e-3), 64 * 1024)
        subprocess.run(["tc", "-n", self.namespace(self.names[host]), "qdisc", "add", "dev",
                        f"{self.prefix}e{host}", "root", "tbf", "rate", f"{gbit}gbit",
                        "burst", str(burst), "latency", "100ms"],
                       check=True, capture_output=True)

    def run_job(self, ranks_per_host, command, forward=(), env=None, pin=True, timeout=None,
                ranks=None):
        """Runs `command` under Open MPI's mpiexec with up to `ranks_per_host` ranks on
        every host, filled in order (`ranks` in all, by default every slot), launched from
        h0; the finished process, output captured as text. `env` is
        set for the launcher and forwarded (with the names in `forward`) to every rank.
        With `pin`, rank r runs on core r modulo this machine's cores: the hosts share
        them, and unpinned ranks would wander onto each other's."""
        from kdist.cli import mpiexec_command

        env = dict(env or {})
        forward = sorted(set(forward) | set(env))
        extra = self.mpi_args(ranks_per_host, forward=forward) + ["--bind-to", "none"]
        if pin:
            cores = os.cpu_count() or 1
            command = ["sh", "-c", f"exec taskset -c $((OMPI_COMM_WORLD_RANK % {cores})) "
                       + shlex.join(command)]
        argv, full_env = mpiexec_command(ranks or ranks_per_host * self.count, command,
                                         extra=extra)
        full_env.update(env)
        return subprocess.run(self.on_first_host(argv), env=full_env, capture_output=True,
                              text=True, timeout=timeout)

    def mpi_args(self, ranks_per_host, forward=()):
        """Open MPI arguments that place `ranks_per_host` ranks on each host, start the
        other hosts' daemons through the agent, keep MPI's traffic on the hosts' subnet,
        and pass the environment variables `forward` to every rank."""
        slots = ",".join(f"{name}:{ranks_per_host}" for name in self.names)
        args = ["-H", slots, "--mca", "plm_rsh_agent", self.agent,
                "--mca", "btl_tcp_if_include", self.subnet,
                "--prtemca", "oob_tcp_if_include", self.subnet]
        for name in forward:
            args += ["-x", name]
        return args

    def on_first_host(self, argv):
        """`argv` run on h0, as the launching node."""
        command = "hostname h0; exec " + " ".join(shlex.quote(a) for a in argv)
        return ["ip", "netns", "exec", self.namespace("h0"), "unshare", "--uts", "sh", "-c",
                command]
