"""A one-host Slurm cluster for the tests: Debian's munged, slurmctld and slurmd, started as
root with everything (key, sockets, state, logs, ports) in a directory of the test's own, and
stopped afterwards. The node is ``localhost`` with more CPUs than the host has
(``config_overrides``), so several agents can run on it as loopback nodes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
from scrape import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")
IDLE_S = 60.0  # slurmd registering with slurmctld, on two busy cores
STOP_S = 30.0


def missing() -> str | None:
    """Why a cluster cannot be started here, or None."""
    absent = [name for name in DAEMONS if shutil.which(name) is None]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)}: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs as their user"
    return None


class SlurmCluster:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        for sub in ("state", "spool", "run"):
            (directory / sub).mkdir(mode=0o700)
        self.socket = directory / "run" / "munge.sock"
        self.conf = directory / "slurm.conf"

    def start(self) -> SlurmCluster:
        run = self.dir / "run"
        key = run / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        subprocess.run(
            [
                "munged",
                "--force",  # as root, with a key of its own
                f"--key-file={key}",
                f"--socket={self.socket}",
                f"--pid-file={run / 'munged.pid'}",
                f"--log-file={run / 'munged.log'}",
                f"--seed-file={run / 'munged.seed'}",
            ],
            check=True,
            timeout=30,
        )
        self.conf.write_text(self._config())
        subprocess.run(["slurmctld", "-f", str(self.conf), "-i"], check=True, timeout=30)
        subprocess.run(["slurmd", "-f", str(self.conf), "-N", "localhost"], check=True, timeout=30)
        self._wait_idle()
        return self

    def _config(self) -> str:
        d = self.dir
        return f"""\
ClusterName=flashrecovery
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
StateSaveLocation={d / "state"}
SlurmdSpoolDir={d / "spool"}
SlurmctldPidFile={d / "run" / "slurmctld.pid"}
SlurmdPidFile={d / "run" / "slurmd.pid"}
SlurmctldLogFile={d / "run" / "slurmctld.log"}
SlurmdLogFile={d / "run" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + IDLE_S
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-o", "%T", check=False).strip()
            if state == "idle":
                return
            time.sleep(0.5)  # slurmd registers on its own schedule: nothing to wait on
        raise AssertionError(f"the Slurm node is not idle within {IDLE_S:.0f}s: {state!r}")

    def run(self, *argv: str, check: bool = True, env: dict[str, str] | None = None) -> str:
        """A Slurm command against this cluster (``env``: the environment it has, which sbatch
        hands on to the job); its standard output."""
        done = subprocess.run(
            argv,
            env={**(env or os.environ), "SLURM_CONF": str(self.conf)},
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: rc {done.returncode}: {done.stderr}")
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields of a job (kept for MinJobAge after it ends)."""
        text = self.run("scontrol", "show", "job", "-o", job_id)
        return dict(field.split("=", 1) for field in text.split() if "=" in field)

    def stop(self) -> None:
        self.run("scancel", "--full", "--user", "root", check=False)
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = self.dir / "run" / f"{name}.pid"
            if not pid_file.exists():
                continue
            try:
                process = psutil.Process(int(pid_file.read_text().split()[0]))
                process.send_signal(signal.SIGTERM)
                _, alive = psutil.wait_procs([process], timeout=STOP_S)
                for left in alive:
                    left.kill()
            except (psutil.NoSuchProcess, ValueError):
                continue
