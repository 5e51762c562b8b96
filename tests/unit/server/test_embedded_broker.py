"""The embedded broker (``server/jobs/embedded_broker.py``): a message file a consumer can list is always whole.

The race of kombu's own filesystem transport (fresh-user finding, 2026-12-04: the embedded Celery worker stopped for
good on ``JSONDecodeError``) is reproduced with a consumer that lists the folder while the producer writes: with
kombu's ``_put`` it reads an empty file at once; with ours it never sees a partial one."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from kombu import Connection
from kombu.transport import filesystem

from server.jobs.embedded_broker import Channel, register

BIG = {"body": "x" * 2_000_000}  # a 2 MB message: its write takes long enough for a listing to land inside it


def _partial_reads(tmp_path: Path, put: object) -> int:
    """Write 20 big messages with ``put`` while a thread keeps reading every listed message file; how many of the
    files it read were not a whole message."""
    folder = tmp_path / "q"
    folder.mkdir(parents=True)
    channel = Channel.__new__(Channel)  # only the folders are used by _put
    channel.__dict__["data_folder_out"] = str(folder)
    done, partial = threading.Event(), [0]

    def consume() -> None:
        while not done.is_set():
            for name in os.listdir(folder):
                if name.endswith(".msg"):
                    try:
                        data = (folder / name).read_bytes()
                    except FileNotFoundError:
                        continue
                    if len(data) < 2_000_000:
                        partial[0] += 1

    reader = threading.Thread(target=consume)
    reader.start()
    for _ in range(20):
        put(channel, "celery", BIG)  # type: ignore[operator]
    done.set()
    reader.join()
    return partial[0]


def test_kombus_own_put_lists_an_empty_file_before_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, int]] = []

    def lock(*_: object) -> None:  # called between kombu's open() and its write(): what a consumer sees
        seen.extend((n, (tmp_path / n).stat().st_size) for n in os.listdir(tmp_path) if n.endswith(".msg"))

    monkeypatch.setattr(filesystem, "lock", lock)
    monkeypatch.setattr(filesystem, "unlock", lambda f: None)
    channel = filesystem.Channel.__new__(filesystem.Channel)
    channel.__dict__["data_folder_out"] = str(tmp_path)
    filesystem.Channel._put(channel, "celery", BIG)
    assert [size for _, size in seen] == [0]  # listed under its final name, empty: the consumer's JSONDecodeError


def test_ours_never_shows_a_partial_message_to_a_racing_consumer(tmp_path: Path) -> None:
    assert _partial_reads(tmp_path, Channel._put) == 0


def test_register_makes_filesystem_urls_use_it(tmp_path: Path) -> None:
    register()
    options = {"data_folder_in": str(tmp_path), "data_folder_out": str(tmp_path), "control_folder": str(tmp_path)}
    with Connection("filesystem://", transport_options=options) as conn:
        assert isinstance(conn.default_channel, Channel)
        queue = conn.SimpleQueue("q")
        queue.put({"run": 7})
        assert queue.get(timeout=5).payload == {"run": 7}
        queue.close()
