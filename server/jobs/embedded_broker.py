"""The embedded mode's Celery broker: kombu's filesystem transport with whole-message writes.

kombu 5.7's filesystem transport creates a message file under its final name and then locks and writes it; the
consumer lists the folder, moves each matching file away and reads it without taking the lock. A consumer that lists
the folder between the writer's ``open`` and its ``write`` moves an empty (or half-written) file, ``json.loads``
raises, and the Celery worker stops for good ("Unrecoverable error: JSONDecodeError", seen by a fresh user with an
embedded server and worker submitting and stopping runs). Here a message is written under a name the consumer
never matches (a leading ``.`` and a ``.tmp`` suffix) and renamed into place: a rename within one folder is atomic,
so a listed message file is always whole.

``register()`` points kombu's ``filesystem://`` URL at this transport in the calling process (the server, which
sends tasks, and the worker, which takes them, both import ``server.jobs.celery_app``, which calls it).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> Any:  # type: ignore[override]  # as kombu's own
        """Write the message to a hidden temporary file, then rename it to a name kombu takes in send order
        (``<ns, 20 digits>_<uuid>.<queue>.msg``).

        Raises:
            kombu.exceptions.ChannelError: the folder cannot be written.
        """
        # kombu takes the files in name order: a fixed-width nanosecond clock keeps them in send order (kombu's own
        # millisecond names tie within a millisecond, then order by the random uuid; and sort 9999 before 10000)
        name = f"{time.monotonic_ns():020d}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        tmp = os.path.join(self.data_folder_out, f".{name}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(dumps(payload).encode())
            os.replace(tmp, final)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise filesystem.ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel


def register() -> None:
    """Make ``filesystem://`` mean this transport in this process."""
    TRANSPORT_ALIASES["filesystem"] = f"{__name__}:Transport"
