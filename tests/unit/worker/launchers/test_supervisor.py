"""The environment of a service-launched run (``worker.launchers.supervisor.run_env``,
``worker.run.procs.run_environ``): the run's processes see their own token and what they need, never the service's
database or broker URL, its secret or another run's token; checked on real processes started as runs start theirs."""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from worker.launchers import supervisor

SECRETS = {
    "DATABASE_URL": "postgresql+psycopg://asyncrl:hunter2@127.0.0.1:5432/asyncrl",
    "CELERY_BROKER_URL": "redis://:hunter2@127.0.0.1:6379/0",
    "SECRET_KEY": "server-secret",
    "ASYNCRL_HOME": "/srv/asyncrl",  # its secret_key file
    "ASYNCRL_RUN_TOKEN": "rt_other_run",
    "ASYNCRL_RUN_ID": "999",
    "HF_TOKEN": "hf_admin",
    "AWS_SECRET_ACCESS_KEY": "aws",
    "PGPASSWORD": "hunter2",
    "NCCL_SECRET_KEY": "x",  # a passing prefix does not carry a credential
}
NEEDED = {"OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1", "TORCH_HOME": "/tmp/th", "LC_ALL": "C.UTF-8"}


@pytest.fixture
def worker_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**SECRETS, **NEEDED}.items():
        monkeypatch.setenv(name, value)


@pytest.mark.usefixtures("worker_environ")
def test_run_env_passes_what_runs_need_and_no_secret() -> None:
    env = supervisor.run_env(7, "rt_own", "http://127.0.0.1:8000")
    assert (set(SECRETS) - {"ASYNCRL_RUN_TOKEN", "ASYNCRL_RUN_ID"}) & set(env) == set()
    assert {k: env.get(k) for k in SECRETS} == {
        **dict.fromkeys(SECRETS),
        "ASYNCRL_RUN_TOKEN": "rt_own",
        "ASYNCRL_RUN_ID": "7",
    }
    assert {k: env[k] for k in NEEDED} == NEEDED
    assert env["PATH"] == os.environ["PATH"] and env["ASYNCRL_SERVER_URL"] == "http://127.0.0.1:8000"
    assert env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")
    assert not any(v in "\n".join(env.values()) for v in ("hunter2", "server-secret", "rt_other_run", "hf_admin"))


@pytest.mark.usefixtures("worker_environ")
def test_allow_lets_an_admin_listed_variable_through_but_never_the_service_secrets() -> None:
    env = supervisor.run_env(7, "rt_own", "http://s", allow=["HF_TOKEN", "DATABASE_URL", "SECRET_KEY"])
    assert env["HF_TOKEN"] == "hf_admin"
    assert "DATABASE_URL" not in env and "SECRET_KEY" not in env


CHILD = """
import json, os, sys, time
from pathlib import Path
from worker.run.procs import spawn
out = Path(sys.argv[1])
(out / "supervisor.json").write_text(json.dumps(dict(os.environ)))
code = "import json, os, sys; open(sys.argv[1], 'w').write(json.dumps(dict(os.environ)))"
proc = spawn([sys.executable, "-c", code, str(out / "trainer.json")], out / "trainer.log")
proc.wait()
"""


@pytest.mark.usefixtures("worker_environ")
def test_a_run_process_started_as_runs_are_cannot_read_the_database_url(tmp_path: Path) -> None:
    """A supervisor is started with ``supervisor.detach`` and ``run_env`` (as ``supervisor.start`` does) and starts
    a run process with ``worker.run.procs.spawn`` (as the local launcher does); both print their whole environment."""
    pid = supervisor.detach(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        supervisor.run_env(7, "rt_own", "http://127.0.0.1:8000"),
        tmp_path / "supervisor.log",
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "trainer.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid > 0 and (tmp_path / "trainer.json").exists(), (tmp_path / "supervisor.log").read_text()
    time.sleep(0.2)  # the file is written in one call; let it close
    for name in ("supervisor.json", "trainer.json"):
        seen = json.loads((tmp_path / name).read_text())
        assert "DATABASE_URL" not in seen and "CELERY_BROKER_URL" not in seen and "SECRET_KEY" not in seen, name
        assert "ASYNCRL_HOME" not in seen and "HF_TOKEN" not in seen, name
        assert (seen["ASYNCRL_RUN_TOKEN"], seen["ASYNCRL_RUN_ID"], seen["OMP_NUM_THREADS"]) == ("rt_own", "7", "2")
    assert os.environ["DATABASE_URL"] == SECRETS["DATABASE_URL"]  # the worker's own environment is unchanged


def test_run_user_is_checked() -> None:
    if os.geteuid() != 0:
        assert supervisor.run_user("") is None
    with pytest.raises(ValueError, match=r"^RUN_USER: no user 'no-such-user-x' on this worker$"):
        supervisor.run_user("no-such-user-x")
    with pytest.raises(ValueError, match=r"^RUN_USER: 'root' is root; name an unprivileged user$"):
        supervisor.run_user("root")


def test_a_run_started_as_run_user_cannot_read_the_secret_key_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """A root worker with ``RUN_USER = nobody``: the detached process runs as nobody (no supplementary groups, its
    own HOME), writes in the home folder given to it, and cannot read the server's generated secret key file. A
    shell stands in for the supervisor: this machine's Python lives under /root, which nobody may not enter."""
    if os.geteuid() != 0:
        with pytest.raises(ValueError, match="not root: it cannot start runs as 'nobody'"):
            supervisor.run_user("nobody")
        return
    from server.core.config import Settings

    user = supervisor.run_user("nobody")
    assert user is not None
    base = Path(tempfile.mkdtemp(prefix="asyncrl-run-user-"))
    try:
        base.chmod(0o755)  # like an output folder: the run user may enter it
        monkeypatch.setenv("ASYNCRL_HOME", str(base / "state"))
        monkeypatch.delenv("SECRET_KEY", raising=False)
        Settings().secret_key()  # the real code path: <ASYNCRL_HOME>/secret_key, 0600
        secret = base / "state" / "secret_key"
        home = base / "runs" / "7"
        home.mkdir(parents=True)
        (home / "spec.json").write_text("{}")
        supervisor.give_home(home, user)
        script = (
            'cd "$1"; id -u > uid; id -G > groups; echo "$HOME" > home; '
            'cat "$2" > read 2> err; echo "${DATABASE_URL:-unset}" > db; '
            'echo "${TORCHINDUCTOR_CACHE_DIR:-unset} ${OMP_NUM_THREADS:-unset}" > caches; touch done'
        )
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_root")  # set by torch in a compiling worker
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        supervisor.detach(
            ["/bin/sh", "-c", script, "sh", str(home), str(secret)],
            supervisor.run_env(7, "rt_own", "http://s"),
            home / "supervisor.log",
            user,
        )
        deadline = time.monotonic() + 30
        while not (home / "done").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        got = {
            name: (home / name).read_text().strip() for name in ("uid", "groups", "home", "read", "err", "db", "caches")
        }
        assert got == {
            "caches": "unset 2",  # the worker's compile cache is not the run's
            "uid": str(user.uid),
            "groups": str(user.gid),
            "home": user.home,
            "read": "",
            "err": f"cat: {secret}: Permission denied",
            "db": "unset",
        }
        assert (home / "spec.json").stat().st_uid == user.uid and (home / "done").stat().st_uid == user.uid
    finally:
        shutil.rmtree(base)


def test_a_supervisor_joins_its_cgroup_before_it_drops_root_and_nothing_of_it_outlives_it() -> None:
    """A root worker starts the supervisor (a shell stands in) as ``nobody`` in the run's cgroup: it is in the cgroup
    as nobody, so are its children, one of which leaves its session. ``terminate`` ends all of them and removes the
    cgroup; a supervisor that exits by itself has what it left killed by the worker's thread that reaps it."""
    from tests.support.server import wait_for
    from worker.run import cgroups
    from worker.run.procs import alive

    user = supervisor.run_user("nobody")
    assert user is not None
    base = Path(tempfile.mkdtemp(prefix="asyncrl-cgroup-"))
    base.chmod(0o755)  # nobody may enter it (pytest's tmp_path is under a 0700 folder)
    scripts = (
        (1, "sleep 300 & echo $! > {h}/pids; setsid sleep 300 & echo $! >> {h}/pids; wait", True),
        (2, "sleep 300 & echo $! > {h}/pids; setsid sleep 300 & echo $! >> {h}/pids", False),
    )
    for n, script, stop in scripts:
        home = base / str(n)
        home.mkdir()
        home.chmod(0o777)
        cg, _ = cgroups.prepare(10**9 + n, home, None)
        assert cg is not None
        report = f"id -u > {home}/uid; cat /proc/self/cgroup > {home}/cgroup; "
        pid = supervisor.detach(
            ["/bin/sh", "-c", report + script.format(h=home)],
            supervisor.run_env(7, "rt_own", "http://s"),
            home / "supervisor.log",
            user,
            cg,
            on_exit=functools.partial(lambda h, c, p: supervisor.after_exit(h, p, c), home, cg),
        )
        try:
            pids_file = home / "pids"
            two = functools.partial(lambda f: len(f.read_text().split()) == 2 if f.exists() else False, pids_file)
            wait_for(two, 10, "2 children")
            children = {int(p) for p in pids_file.read_text().split()}
            assert (home / "uid").read_text().strip() == str(user.uid)
            assert f":/{cg.name}\n" in (home / "cgroup").read_text()
            if stop:
                assert cg.pids() == {pid, *children}
                supervisor.terminate(pid, grace_s=1, cgroup=cg)  # SIGTERM ends its group; the setsid one is killed
            wait_for(functools.partial(lambda c: not c.exists(), cg), 10, "the cgroup removed")
            assert not any(alive(p) for p in {pid, *children})
        finally:
            cgroups.end_run(cg, None, started_before=None)
    shutil.rmtree(base)


RUN_UID_BASE = 1_900_000_000
"""A base no account of a test machine uses (the runs' uids are 1_900_000_041 and 1_900_000_042)."""


def test_run_uid_base_gives_each_run_its_own_uid_and_is_checked(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        with pytest.raises(ValueError, match=r"^RUN_UID_BASE: the worker runs as uid \d+, not root"):
            supervisor.run_user("", run_id=41, uid_base=RUN_UID_BASE, home=tmp_path)
        return
    user = supervisor.run_user("nobody", run_id=41, uid_base=RUN_UID_BASE, home=tmp_path)
    assert user == supervisor.RunUser(
        "asyncrl-run-41", RUN_UID_BASE + 41, RUN_UID_BASE + 41, str(tmp_path / "user-home")
    )
    nobody = __import__("pwd").getpwnam("nobody").pw_uid
    with pytest.raises(ValueError, match=rf"^RUN_UID_BASE: run 2's uid {nobody} belongs to the account 'nobody'; "):
        supervisor.run_user("", run_id=2, uid_base=nobody - 2, home=tmp_path)
    with pytest.raises(
        ValueError, match=r"^RUN_UID_BASE: run 5's uid 2147483648 passes 2147483647; lower RUN_UID_BASE$"
    ):
        supervisor.run_user("", run_id=5, uid_base=2**31 - 5, home=tmp_path)


def test_runs_with_their_own_uids_cannot_read_signal_or_write_each_other() -> None:
    """Two runs started as a root worker with ``RUN_UID_BASE`` starts them (``supervisor.start``'s steps: give_home,
    then ``detach`` as the run's user), shells standing in for supervisors (this machine's Python lives under /root,
    which no other uid may enter). Run 41 tries, against run 42's process: read its environment (its run token), send
    it a signal, write into its home folder, read a file of it or list it (the home is 2750, in the group of the folder
    of homes); each is refused by the kernel, while run 41 reads its own environment and files."""
    base = Path(tempfile.mkdtemp(prefix="asyncrl-run-uids-"))
    try:
        base.chmod(0o755)
        homes = {n: base / "runs" / str(n) for n in (41, 42)}
        users: dict[int, supervisor.RunUser] = {}
        for n, home in homes.items():
            home.mkdir(parents=True)
            user = supervisor.run_user("", run_id=n, uid_base=RUN_UID_BASE, home=home)
            assert user is not None
            users[n] = user
            Path(users[n].home).mkdir()
            (home / "spec.json").write_text("{}")
            supervisor.give_home(home, users[n])
            assert (home.stat().st_mode & 0o7777, home.stat().st_gid) == (0o2750, (base / "runs").stat().st_gid)
        victim = supervisor.detach(
            ["/bin/sh", "-c", 'echo $$ > "$HOME/pid"; exec sleep 120'],
            supervisor.run_env(42, "rt_run_42_secret", "http://s"),
            homes[42] / "supervisor.log",
            users[42],
        )
        probe = (
            'cd "$HOME"; id -u > uid; echo "$HOME" > home; '
            'tr "\\0" "\\n" < /proc/$$/environ | grep -c ASYNCRL_RUN_TOKEN=rt_run_41 > own; '
            'cat "/proc/$1/environ" > other 2> other_err; echo $? > other_rc; '
            'kill -0 "$1" 2> kill_err; echo $? > kill_rc; '
            'touch "$2/planted" 2> write_err; echo $? > write_rc; '
            'cat "$2/spec.json" > read 2> read_err; echo $? > read_rc; ls "$2" > list 2> list_err; echo $? > list_rc; '
            'cat "$3/spec.json" > own_read; touch done'
        )
        deadline = time.monotonic() + 30
        while not (Path(users[42].home) / "pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        supervisor.detach(
            ["/bin/sh", "-c", probe, "sh", str(victim), str(homes[42]), str(homes[41])],
            supervisor.run_env(41, "rt_run_41_secret", "http://s"),
            homes[41] / "supervisor.log",
            users[41],
        )
        out = Path(users[41].home)
        while not (out / "done").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        got = {
            name: (out / name).read_text().strip()
            for name in ("uid", "home", "own", "other", "other_rc", "kill_rc", "write_rc", "read_rc", "list_rc")
        }
        assert got == {
            "uid": str(RUN_UID_BASE + 41),
            "home": str(out),
            "own": "1",
            "other": "",
            "other_rc": "1",
            "kill_rc": "1",
            "write_rc": "1",
            "read_rc": "1",
            "list_rc": "2",
        }
        assert (out / "own_read").read_text() == "{}"
        assert "Permission denied" in (out / "other_err").read_text()
        assert "not permitted" in (out / "kill_err").read_text()
        assert "Permission denied" in (out / "write_err").read_text()
        assert "Permission denied" in (out / "read_err").read_text()
        assert "Permission denied" in (out / "list_err").read_text()
        assert not (homes[42] / "planted").exists()
        status = Path(f"/proc/{victim}/status").read_text()
        assert f"Uid:\t{RUN_UID_BASE + 42}\t" in status  # still alive, as its own uid
        os.kill(victim, 9)
    finally:
        shutil.rmtree(base)


def test_give_home_copies_a_hard_linked_file_before_changing_its_owner(tmp_path: Path) -> None:
    """A fork's checkpoint files are hard links to its parent's: the child's uid must get a copy, never the parent's
    inode (which it could then rewrite)."""
    parent = tmp_path / "parent.safetensors"
    parent.write_bytes(b"weights of the parent")
    home = tmp_path / "runs" / "8"
    (home / "ckpt").mkdir(parents=True)
    os.link(parent, home / "ckpt" / "model.safetensors")
    owner = (parent.stat().st_uid, parent.stat().st_gid)
    supervisor.give_home(home, supervisor.RunUser("run-8", 60_008, 60_008, str(home)))
    child = home / "ckpt" / "model.safetensors"
    group = home.parent.stat().st_gid  # the folder of homes' (the server's) group
    assert (child.stat().st_uid, child.stat().st_gid) == (60_008, group) and child.read_bytes() == parent.read_bytes()
    assert (parent.stat().st_uid, parent.stat().st_gid) == owner and parent.stat().st_nlink == 1
    assert [p.name for p in (home / "ckpt").iterdir()] == ["model.safetensors"]  # no temporary left


def test_giving_a_home_again_follows_no_link_the_run_planted(tmp_path: Path) -> None:
    """A relaunch gives the home to its uid again while the run's own files are in it: a file it hard-linked twice gets
    a copy of its own, made under a fresh name, so the link it planted at the old copy's name (to a root-only file) is
    not written through; a link to a root file keeps that file root's."""
    secret = tmp_path / "secret"
    secret.write_text("root only")
    secret.chmod(0o600)
    home = tmp_path / "runs" / "9"
    (home / "rl").mkdir(parents=True)
    (home / "rl" / "a").write_bytes(b"the run's bytes")
    os.link(home / "rl" / "a", home / "rl" / "b")
    (home / "rl" / ".a.own").symlink_to(secret)
    (home / "rl" / "key").symlink_to(secret)
    user = supervisor.RunUser("run-9", 60_009, 60_009, str(home))
    supervisor.give_home(home, user)
    assert secret.read_text() == "root only" and (secret.stat().st_uid, secret.stat().st_mode & 0o777) == (0, 0o600)
    a, b = home / "rl" / "a", home / "rl" / "b"
    assert a.read_bytes() == b.read_bytes() == b"the run's bytes" and a.stat().st_ino != b.stat().st_ino
    assert {p.name: p.lstat().st_uid for p in (home / "rl").iterdir()} == dict.fromkeys(
        ["a", "b", ".a.own", "key"], 60_009
    )


def test_a_root_worker_with_nothing_set_runs_each_run_as_its_own_uid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither ``RUN_USER`` nor ``RUN_UID_BASE``: a root worker runs run ``n`` as uid ``DEFAULT_RUN_UID_BASE + n``
    (never as root), any other worker as itself (None); a set ``RUN_UID_BASE`` or ``RUN_USER`` still wins."""
    assert supervisor.DEFAULT_RUN_UID_BASE == 1_900_000_000
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert supervisor.run_user("", run_id=7, home=tmp_path) == supervisor.RunUser(
        "asyncrl-run-7", 1_900_000_007, 1_900_000_007, str(tmp_path / "user-home")
    )
    own_base = supervisor.run_user("", run_id=7, uid_base=RUN_UID_BASE - 1000, home=tmp_path)
    assert own_base is not None and own_base.uid == RUN_UID_BASE - 993
    account = supervisor.run_user("nobody", run_id=7, home=tmp_path)
    assert account is not None and account.name == "nobody"
    with pytest.raises(ValueError, match=r"^RUN_UID_BASE: a run's own uid needs its run id and home folder$"):
        supervisor.run_user("")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert supervisor.run_user("", run_id=7, home=tmp_path) is None


def python_in_a_private_folder() -> tuple[Path, Path]:
    """A copy of this Python in a folder of its own (0700, root's): no other uid may run it. (folder, python)"""
    folder = Path(tempfile.mkdtemp(prefix="asyncrl-private-python-"))
    python = folder / "python"
    shutil.copy2(os.path.realpath(sys.executable), python)
    return folder, python


@pytest.mark.skipif(os.geteuid() != 0, reason="only root starts processes as another uid")
def test_a_python_the_run_uid_cannot_run_is_refused_in_one_line_saying_how_to_fix_it(tmp_path: Path) -> None:
    """``check_python`` really starts ``import worker`` as the run's uid: this Python passes (its folders are open to
    other users: scripts/setup.sh), a copy in a 0700 folder is refused with one line naming the folder to open, and
    ``supervisor.start`` refuses the launch the same way before anything of the run is written or started."""
    user = supervisor.run_user("", run_id=7, uid_base=RUN_UID_BASE, home=tmp_path)
    assert user is not None
    supervisor.check_python(user)  # tmp_path: this Python, as the run's uid
    folder, python = python_in_a_private_folder()
    try:
        line = (
            f"the run user asyncrl-run-7 (uid {RUN_UID_BASE + 7}) cannot run this worker's Python {python} "
            f"(Permission denied): make it usable by other users (e.g. `chmod o+x {folder}`; scripts/setup.sh does) "
            "or set RUN_USER to an account that can"
        )
        with pytest.raises(ValueError) as refused:
            supervisor.check_python(user, str(python))
        assert str(refused.value) == line
        assert supervisor.folder_in_the_way(str(python), user.uid, user.gid) == folder
        assert supervisor.folder_in_the_way(sys.executable, user.uid, user.gid) is None
        home = tmp_path / "runs" / "7"
        home.mkdir(parents=True)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "executable", str(python))
            with pytest.raises(ValueError, match=r"^the run user asyncrl-run-7 .* cannot run this worker's Python"):
                supervisor.start(home, run_id=7, spec={}, token="rt", server_url="http://s", user=user)
        assert list(home.iterdir()) == [] and home.stat().st_uid == 0
        folder.chmod(0o711)  # fixed: the same check passes without restarting the worker (failures are not kept)
        supervisor.check_python(user, str(python))
    finally:
        shutil.rmtree(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root starts processes as another uid")
def test_a_run_home_the_run_uid_cannot_enter_is_refused() -> None:
    folder = Path(tempfile.mkdtemp(prefix="asyncrl-private-outputs-"))  # 0700: ASYNCRL_OUTPUT_DIR under it
    try:
        home = folder / "runs" / "7"
        home.mkdir(parents=True)
        user = supervisor.run_user("", run_id=7, uid_base=RUN_UID_BASE, home=home)
        assert user is not None
        with pytest.raises(ValueError) as refused:
            supervisor.start(home, run_id=7, spec={}, token="rt", server_url="http://s", user=user)
        assert str(refused.value) == (
            f"the run user asyncrl-run-7 (uid {RUN_UID_BASE + 7}) cannot enter {folder}, above its home folder {home}: "
            f"`chmod o+x {folder}`, or set ASYNCRL_OUTPUT_DIR to a folder other users may enter"
        )
        assert list(home.iterdir()) == []
    finally:
        shutil.rmtree(folder)
