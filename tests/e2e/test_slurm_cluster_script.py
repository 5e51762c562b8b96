"""The multi-node test cluster's script (``deploy/slurm/multi-node-cluster.sh``) on this machine, for real: the munge
key is never readable by others, slurmctld listens on the bridge address only, and ``stop`` removes the network it
made (namespaces, veths, bridge, hosts files) so that ``start`` brings the same cluster back. Run as root under the
heavy lock: the stop/start test takes the cluster away from the multi-node tests for a few seconds."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

SCRIPT = Path(__file__).resolve().parents[2] / "deploy/slurm/multi-node-cluster.sh"
SLURM_CONF = "/etc/slurm-multi/slurm.conf"
NODES = ("asrl-n1", "asrl-n2", "asrl-n3")


def sh(cmd: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", cmd], capture_output=True, text=True, timeout=120, env={**os.environ, **env}, check=False
    )


def test_munge_key_is_written_under_umask_077(tmp_path: Path) -> None:
    """The key's mode right after ``dd`` wrote it (a wrapper around ``dd`` reads it before the script's chmod) is
    0600 under the caller's umask 022: the key was never world-readable, then it ends 0400 and the munge user's."""
    key = tmp_path / "munge.key"
    seen = tmp_path / "mode-after-dd"
    done = sh(
        f'source {SCRIPT}; umask 022; dd() {{ command dd "$@"; stat -c %a {key} > {seen}; }}; munge_key {key}; '
        f"munge_key {key}"  # twice: a key already there is kept
    )
    assert done.returncode == 0, done.stderr
    assert seen.read_text() == "600\n"  # once: the second call kept the key
    assert (oct(key.stat().st_mode & 0o777), key.stat().st_size) == ("0o400", 1024)
    assert sh(f"stat -c %U:%G {key}").stdout == "munge:munge\n"


def listeners(port: int) -> list[str]:
    out = sh(f"ss -Hltn 'sport = :{port}'").stdout
    return sorted(line.split()[3] for line in out.splitlines())


def test_slurmctld_listens_on_the_bridge_address_only() -> None:
    assert Path(SLURM_CONF).exists(), "start the cluster: bash deploy/slurm/multi-node-cluster.sh start"
    assert listeners(6917) == ["10.77.0.1:6917"]  # not 0.0.0.0: no other interface of the machine reaches it


@pytest.mark.timing  # start within 60 s: alone
def test_stop_removes_the_network_and_start_brings_the_cluster_back() -> None:
    assert sh(f"bash {SCRIPT} stop").returncode == 0
    try:
        namespaces = [line.split()[0] for line in sh("ip netns list").stdout.splitlines()]
        assert [ns for ns in namespaces if ns.startswith("asrl-")] == []
        links = sh("ip -o link show").stdout
        assert "asrl-br0" not in links and "asrl-v" not in links
        assert not any(Path(f"/etc/netns/{n}").exists() for n in NODES)
        assert listeners(6917) == [] and listeners(6918) == []
        again = sh(f"bash {SCRIPT} stop")  # idempotent: nothing left to stop is no error
        assert (again.returncode, again.stderr) == (0, "")
    finally:
        t0 = time.monotonic()
        started = sh(f"bash {SCRIPT} start")
    assert started.returncode == 0, started.stderr
    assert time.monotonic() - t0 < 60
    states = sh("sinfo -h -N -o '%N %T'", SLURM_CONF=SLURM_CONF).stdout.split("\n")
    assert sorted(s for s in states if s) == [f"{n} idle" for n in NODES]
    assert listeners(6917) == ["10.77.0.1:6917"]
    ips = {n: sh(f"ip -n {n} -4 -o addr show dev eth0").stdout.split()[3] for n in NODES}
    assert ips == {"asrl-n1": "10.77.0.11/24", "asrl-n2": "10.77.0.12/24", "asrl-n3": "10.77.0.13/24"}
