"""The trainer's ``TCPStore`` server, listening on the configured address only.

torch's ``TCPStore(host_name, port, is_master=True)`` binds its server to every interface whatever ``host_name``
says (torch 2.13: ``ss -ltn`` shows ``*:<port>``), so with the default ``master_addr = 127.0.0.1`` the weight-sync
rendezvous was still reachable from other machines. :func:`master_store` binds the listening socket to
``host:port`` itself and hands it to torch (``master_listen_fd``, which the default libuv backend takes).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any


def master_store(host: str, port: int, world_size: int, *, timeout_s: float) -> Any:
    """A master ``torch.distributed.TCPStore`` of ``world_size`` members listening on ``host:port`` only (``port``
    0: a free one; read it from ``.port``). Does not wait for the members.

    Raises:
        OSError: ``host`` does not resolve, or ``host:port`` cannot be bound (in use, not a local address).
    """
    from torch.distributed import TCPStore

    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        store = TCPStore(
            host,
            sock.getsockname()[1],
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now
    return store
