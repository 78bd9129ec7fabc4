"""A real multi-node SLURM cluster on this one host, started and stopped by the tests.

Debian's slurm-wlm is built with --enable-multiple-slurmd, so several slurmd can run on one machine, each
as a node of its own (`slurmd -N NAME`, a port each). The nodes are named by loopback addresses
(127.0.0.1, 127.0.0.2): every name in SLURM_JOB_NODELIST then resolves and answers, as on a cluster, so a
rendezvous on the first node works without touching /etc/hosts.

Each node declares `Gres=gpu:G` backed by placeholder files. They are NOT devices (there is no GPU here):
they make `#SBATCH --gpus-per-node=G` schedulable and make slurmd itself set SLURM_GPUS_ON_NODE in every
step, exactly the variables a real GPU node gives nest-megatron. slurmd logs "is not a valid character or
block device" for them and counts them anyway.

munged runs as the munge user with its own key and socket, the slurm daemons as root (SlurmUser=root),
all state, logs and sockets under one temporary folder that `stop()` removes. Nothing is read from or
written to /etc.
"""

from __future__ import annotations

import atexit
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "munge", "unmunge", "slurmctld", "slurmd", "sinfo", "srun", "sbatch", "scancel", "squeue")
APT_HINT = "install the Debian packages in .ci/apt-packages (slurmctld slurmd slurm-client munge)"


class SlurmClusterError(RuntimeError):
    pass


def binary(name: str) -> str | None:
    """Daemons live in /usr/sbin, which a non-login PATH may lack."""
    return shutil.which(name) or next((str(p) for p in [Path("/usr/sbin", name)] if p.exists()), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_environment() -> dict[str, str]:
    """This process's environment without any SLURM_* of an outer allocation (CI may itself run in one)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}


class SlurmCluster:
    def __init__(self, num_nodes: int = 2, gpus_per_node: int = 2, start_timeout_s: float = 60.0,
                 topology: str | None = None):
        self.node_names = [f"127.0.0.{i + 1}" for i in range(num_nodes)]
        self.gpus_per_node = gpus_per_node
        self.topology = topology  # a topology.conf for the tree plugin (None: no switch tree)
        self.start_timeout_s = start_timeout_s
        self.root: Path | None = None
        self.processes: dict[str, subprocess.Popen] = {}
        self.start_seconds: float | None = None

    # -- paths -----------------------------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def log_paths(self) -> list[Path]:
        return sorted(self.root.glob("*.log")) + sorted((self.root / "munge").glob("*.log"))

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for srun / sbatch against this cluster; the venv's bin first so jobs find nest-megatron."""
        env = clean_environment()
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")])
        env.update(extra)
        return env

    # -- start / stop ----------------------------------------------------------------------------------
    def start(self, attempts: int = 2) -> SlurmCluster:
        missing = [d for d in DAEMONS if binary(d) is None]
        if missing:
            raise SlurmClusterError(f"{', '.join(missing)} not found: {APT_HINT}")
        if os.geteuid() != 0:
            raise SlurmClusterError("the test SLURM cluster needs root (slurmd starts job steps as their user)")
        try:
            pwd.getpwnam("munge")
        except KeyError:
            raise SlurmClusterError(f"no 'munge' user: {APT_HINT}") from None
        began = time.monotonic()
        for attempt in range(1, attempts + 1):
            try:
                self._start_once()
                self.start_seconds = time.monotonic() - began
                atexit.register(self.stop)  # also when the test session ends without its teardown
                return self
            except SlurmClusterError as e:
                logs = self.logs()
                self.stop()
                if attempt == attempts:
                    raise SlurmClusterError(f"{e} (after {attempts} attempts)\n{logs}") from None
        raise AssertionError("unreachable")

    def _start_once(self) -> None:
        # In /tmp itself, not in TMPDIR: under pytest that is a folder of pytest's (tests/conftest.py), mode 0700,
        # which munged (the munge user) cannot enter. stop() removes it, at exit too.
        self.root = Path(tempfile.mkdtemp(prefix="nest-slurm-", dir="/tmp"))
        self.root.chmod(0o755)  # munged (as the munge user) must reach its socket below it
        self._start_munge()
        self._write_config()
        self._spawn("slurmctld", [binary("slurmctld"), "-D", "-c", "-i"])
        for name in self.node_names:
            (self.root / "spool" / name).mkdir(parents=True)
            self._spawn(f"slurmd-{name}", [binary("slurmd"), "-D", "-N", name])
        self._wait_idle()

    def _spawn(self, name: str, argv: list[str], **kwargs) -> None:
        log = open(self.root / f"{name}.stdout.log", "wb")
        self.processes[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                env=self.env(), start_new_session=True, **kwargs)
        log.close()

    def _start_munge(self) -> None:
        """munged insists: key 0400 owned by its user, socket folder traversable by everyone."""
        munge_dir = self.root / "munge"
        munge_dir.mkdir(mode=0o755)
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for path in (munge_dir, key):
            shutil.chown(path, "munge", "munge")
        self._spawn("munged", [binary("munged"), "-F", f"--key-file={key}", f"--socket={munge_dir / 'munge.socket'}",
                               f"--pid-file={munge_dir / 'munged.pid'}", f"--log-file={munge_dir / 'munged.log'}",
                               f"--seed-file={munge_dir / 'munged.seed'}"], user="munge", group="munge")
        socket_path = munge_dir / "munge.socket"
        self._wait(lambda: socket_path.exists(), "munged to create its socket")
        check = subprocess.run(f"munge -S {socket_path} -n | unmunge -S {socket_path}", shell=True,
                               capture_output=True, text=True, timeout=20)
        if check.returncode != 0:
            raise SlurmClusterError(f"munge round trip failed: {check.stderr.strip()}")

    def _write_config(self) -> None:
        r = self.root
        ctld_port, node_ports = free_port(), [free_port() for _ in self.node_names]
        (r / "dev").mkdir()
        for i in range(self.gpus_per_node):  # placeholder "GPU" files, see the module docstring
            (r / "dev" / f"nvidia{i}").touch()
        nodes = "\n".join(
            # CPUs=1: never more than the host has (slurmd drains a node that reports fewer)
            f"NodeName={name} NodeAddr={name} NodeHostname=localhost Port={port} CPUs=1 "
            f"RealMemory=1000 Gres=gpu:{self.gpus_per_node} State=UNKNOWN"
            for name, port in zip(self.node_names, node_ports)
        )
        # A job's rendezvous port is 20000 + its job id (launch/devices.py): two clusters of parallel test workers
        # number their jobs from where their distinct controller ports say, not both from 1; ids below 12768 keep
        # those ports under Linux's ephemeral range (32768-60999), where free_port() finds the daemons' ports.
        first_job_id = 1 + ctld_port % 10000
        self.conf.write_text(f"""\
ClusterName=nesttest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
FirstJobId={first_job_id}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={r / 'munge' / 'munge.socket'}
CredType=cred/munge
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}/%n
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'spool'}/%n/slurmd.pid
SlurmctldLogFile={r / 'slurmctld.log'}
SlurmdLogFile={r}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
GresTypes=gpu
ReturnToService=2
InactiveLimit=0
KillWait=5
MessageTimeout=20
SlurmdTimeout=120
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
{"TopologyPlugin=topology/tree" if self.topology else ""}
""")
        if self.topology:  # slurmctld reads topology.conf beside slurm.conf
            (r / "topology.conf").write_text(self.topology)
        names = f"{self.node_names[0].rsplit('.', 1)[0]}.[1-{len(self.node_names)}]"
        (r / "gres.conf").write_text(f"NodeName={names} Name=gpu File={r / 'dev'}/nvidia[0-{self.gpus_per_node - 1}]\n")
        (r / "state").mkdir()

    def _wait(self, ready, what: str, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        while time.monotonic() < deadline:
            dead = [n for n, p in self.processes.items() if p.poll() is not None]
            if dead:
                raise SlurmClusterError(f"{', '.join(dead)} exited while waiting for {what}")
            if ready():
                return
            time.sleep(0.2)
        raise SlurmClusterError(f"timed out after {timeout_s or self.start_timeout_s:.0f} s waiting for {what}")

    def node_states(self) -> dict[str, str]:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env(),
                             timeout=20)
        return dict(line.split() for line in out.stdout.splitlines() if line.strip())

    def _wait_idle(self) -> None:
        self._wait(lambda: self.node_states() == {n: "idle" for n in self.node_names},
                   f"sinfo to show {', '.join(self.node_names)} idle")

    def stop(self) -> None:
        if self.root is None:
            return
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            # end running jobs first: their slurmstepd outlive a stopped slurmd
            subprocess.run(["scancel", "--user", pwd.getpwuid(os.geteuid()).pw_name], env=self.env(),
                           capture_output=True, timeout=20)
            try:
                self._wait(lambda: not self.squeue(), "cancelled jobs to end", timeout_s=30)
            except SlurmClusterError:
                pass
        for name in reversed(list(self.processes)):  # slurmd, then slurmctld, then munged
            proc = self.processes[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        self.processes.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    # -- use -------------------------------------------------------------------------------------------
    def squeue(self) -> list[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, env=self.env(),
                             timeout=20)
        return out.stdout.split("\n") if out.stdout.strip() else []

    def run(self, argv: list[str], *, timeout_s: float = 120, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env or self.env(), cwd=cwd)

    def logs(self, tail_lines: int = 25) -> str:
        """The last lines of every daemon log, for a failure message."""
        if self.root is None or not self.root.exists():
            return "(no daemon logs)"
        parts = []
        for path in self.log_paths():
            lines = path.read_text(errors="replace").splitlines()[-tail_lines:]
            parts.append(f"--- {path.name} ---\n" + "\n".join(lines))
        return "\n".join(parts)


def running_cluster(**kwargs):
    """A started SlurmCluster for a module fixture (yielded, stopped after), or the test fails with
    why it did not start."""
    import pytest

    slurm = SlurmCluster(**kwargs)
    try:
        slurm.start()
    except SlurmClusterError as e:
        pytest.fail(f"the test SLURM cluster did not start: {e}", pytrace=False)
    yield slurm
    slurm.stop()
