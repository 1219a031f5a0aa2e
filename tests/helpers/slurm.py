"""A real Slurm cluster on this machine for tests: munged, slurmctld and one slurmd per node (`slurmd -N`),
each started by pid with a private config, private ports and a private munge socket, and stopped by pid.

Needs Debian's `slurm-wlm` and `munge` (`.ci/run` installs them) and root (slurmd starts jobs as the
submitting user). `SlurmCluster.start()` raises `SlurmUnavailable` with the reason when this machine
cannot run one; the caller skips on it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the test cluster (packages missing, not root)."""


def _free_ports(count: int) -> list[int]:
    socks, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _tool(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for d in ("/usr/sbin", "/usr/bin", "/sbin")
                                       if (p := Path(d) / name).exists()), None)


def missing_tools() -> list[str]:
    return [t for t in (*DAEMONS, *CLIENTS, "mungekey") if _tool(t) is None]


class SlurmCluster:
    """`nodes` slurmd daemons named n1 … nN, all on 127.0.0.1, with the CPUs this machine has."""

    def __init__(self, nodes: int = 2, root: Path | None = None):
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.root = Path(root or tempfile.mkdtemp(prefix="af-slurm-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge" / "munge.socket"

    # ------------------------------------------------------------------ environment
    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, `ascendfactory run`) needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ start / stop
    def start(self, timeout: float = 60) -> "SlurmCluster":
        missing = missing_tools()
        if missing:
            raise SlurmUnavailable(f"Slurm/munge tools not installed: {', '.join(missing)} "
                                   "(apt-get install slurm-wlm munge; .ci/run does)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("the test Slurm cluster runs its daemons as root")
        try:
            self._write_config()
            self._start_munged()
            self._spawn("slurmctld", [_tool("slurmctld"), "-D", "-f", str(self.conf)])
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", [_tool("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel this cluster's jobs (their slurmstepd would outlive slurmd), then stop every daemon this
        object started, by its pid (slurmd first, munged last)."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--partition=debug", check=False)
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(0.5)
        for name in sorted(self.procs, key=lambda n: ("slurmd" not in n, n == "munged")):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.procs.values():
            if log.stdout:
                log.stdout.close()
        self.procs.clear()

    def logs(self) -> str:
        """The daemons' logs (for a failing test's message)."""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                         for p in sorted(self.root.glob("*.log")))

    # ------------------------------------------------------------------ clients
    def run(self, *argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([_tool(argv[0]), *argv[1:]], env={**os.environ, **self.env}, text=True,
                              capture_output=True, check=check, timeout=kw.pop("timeout", 30), **kw)

    def job_state(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_job(self, job_id: str, timeout: float = 240) -> dict[str, str]:
        """Wait until the job leaves the running states; → its scontrol record."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state.get("JobState") not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"):
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {self.job_state(job_id).get('JobState')} after {timeout}s\n"
                           + self.logs())

    # ------------------------------------------------------------------ internals
    def _write_config(self) -> None:
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        host = socket.gethostname().split(".")[0]
        cpus = os.cpu_count() or 1
        r = self.root
        lines = [
            "ClusterName=aftest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            f"AuthInfo=socket={self.socket}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/affinity",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={r / 'jobcomp.txt'}",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SwitchType=switch/none",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "InactiveLimit=0",
            "KillWait=30",
            "MinJobAge=600",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        for node, port in zip(self.nodes, node_ports):
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _start_munged(self) -> None:
        mdir = self.socket.parent
        mdir.mkdir(mode=0o700, exist_ok=True)
        key = mdir / "munge.key"
        subprocess.run([_tool("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
        key.chmod(0o600)
        self._spawn("munged", [_tool("munged"), "-F", "--force", f"--socket={self.socket}", f"--key-file={key}",
                               f"--pid-file={mdir / 'munged.pid'}", f"--seed-file={mdir / 'munged.seed'}",
                               f"--log-file={self.root / 'munged.log'}"])
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise SlurmUnavailable("munged did not start:\n" + self.logs())
            time.sleep(0.05)

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = (self.root / f"{name}.out").open("wb")
        self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                            start_new_session=True)
        out.close()

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with {proc.returncode}:\n"
                                           + (self.root / f"{name}.out").read_text(errors="replace") + self.logs())
            res = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
            states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
            if res.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.3)
        raise SlurmUnavailable(f"the Slurm nodes did not come up in {timeout}s:\n{self.logs()}")
