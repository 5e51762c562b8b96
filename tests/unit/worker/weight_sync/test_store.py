"""The trainer's TCPStore listens on master_addr only (torch's own binds every interface)."""

from __future__ import annotations

import subprocess
from datetime import timedelta

from worker.weight_sync.store import master_store


def listening(port: int) -> list[str]:
    out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    return sorted(line.split()[3] for line in out.splitlines() if line.split()[3].endswith(f":{port}"))


def test_torch_alone_listens_on_every_interface() -> None:
    """Why master_store exists: TCPStore(host_name="127.0.0.1", is_master=True) listens on *:port (torch 2.13)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    assert listening(store.port) in (["*:" + str(store.port)], [f"0.0.0.0:{store.port}", f"[::]:{store.port}"])


def test_master_store_listens_on_the_address_only_and_serves_members() -> None:
    from torch.distributed import TCPStore

    store = master_store("127.0.0.1", 0, 2, timeout_s=10)
    assert listening(store.port) == [f"127.0.0.1:{store.port}"]
    member = TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=timedelta(seconds=10))
    store.set("version", "7")
    assert member.get("version") == b"7"
    member.set("joined", "1")
    assert store.get("joined") == b"1"
