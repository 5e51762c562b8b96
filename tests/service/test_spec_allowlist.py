"""The allow-list of what a submitted spec hands to a library, as a generated attack suite.

Every text field of every spec kind (RL, SFT, eval; nested tables, arrays of tables, ``env.args`` keys) is declared in
:data:`TEXT_FIELDS` by what a library makes of it: ``plain`` text (names, enum-like options, W&B labels), or a
field that names ``code``, a ``path``, a ``url``, a ``host``, a command-line ``flag``, an environment variable
(``env-name``) or a dataset ``split`` (a plain name). :func:`test_every_text_field_is_declared` walks the schemas and fails on a field missing from the
table, so a new field is refused by this suite until someone says what it is.

Then, as a member (no code permission), for every field that is not plain and every payload of its kind, and for
every ``env.args`` key verifiers reads as code, a file or an address, on every submit route (REST JSON, TOML upload,
the Launch form, the fork API and form, a sweep's base, a pipeline stage, SFT and eval specs): refused 422/403 with
one line naming the field, and nothing created. A NUL in any text field is refused naming the field on the REST
route of every spec kind.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import tomli_w
from pydantic import BaseModel

from tests.service.test_lifecycle import checkpoint
from tests.support.server import BAD_MODEL, new_token, spec
from tests.support.webui import login
from worker.spec import EvalSpec, RLSpec, SFTSpec

TEXT_FIELDS: dict[str, str] = {
    "name": "plain",
    "output_dir": "path",
    "model.name": "path",
    "env.id": "code",
    "env.0.id": "code",
    "env.name": "plain",
    "env.0.name": "plain",
    "env.args.<key>": "env-args",
    "env.0.args.<key>": "env-args",
    "alerts.0.name": "plain",
    "alerts.0.metric": "plain",
    "alerts.0.metrics.0": "plain",
    "inference.url": "url",
    "inference.urls.0": "url",
    "inference.host": "host",
    "inference.extra_args.0": "flag",
    "trainer.weight_sync.master_addr": "host",
    "trainer.loss.import_path": "code",
    "trainer.loss.kwargs.<key>": "plain",  # keyword arguments of an allowed package's function
    "trainer.lora.target_modules.0": "plain",
    "lora.target_modules.0": "plain",
    "orchestrator.advantage.import_path": "code",
    "orchestrator.advantage.kwargs.<key>": "plain",
    "orchestrator.advantage.episode_agents.0": "plain",
    "orchestrator.gates.0.import_path": "code",
    "orchestrator.gates.0.kwargs.<key>": "plain",
    "orchestrator.harness.id": "code",
    "launcher.slurm.account": "plain",
    "launcher.slurm.allocation": "plain",
    "launcher.slurm.partition": "plain",
    "launcher.slurm.reservation": "plain",
    "launcher.slurm.time_limit": "plain",
    "launcher.slurm.extra_sbatch.0": "flag",
    "launcher.slurm.env.<key>": "env-name",
    "monitor.wandb.entity": "plain",
    "monitor.wandb.group": "plain",
    "monitor.wandb.name": "plain",
    "monitor.wandb.project": "plain",
    "monitor.wandb.tags.0": "plain",
    "data.path": "path",
    "data.eval_path": "path",
    "data.split": "split",
    "data.eval_split": "split",
}
"""Every text field of the three spec kinds (``.0`` an array item, ``.<key>`` a table's keys and values) and what
a library makes of it."""

PAYLOADS: dict[str, list[Any]] = {
    "code": ["os:system", "/tmp/evil.py:f", "path/to/evil.py:f", "http://evil.example/x.py"],
    "path": ["/etc/passwd", "../../../etc/shadow", "~/.ssh/id_rsa", "/proc/self/environ"],
    "url": ["http://169.254.169.254/latest", "http://10.0.0.5:8000", "http://evil.example", "file:///etc/passwd"],
    "host": ["0.0.0.0", "10.0.0.5", "evil.example"],
    "flag": [
        "--worker-extension-cls=evil.X",
        "--middleware",
        "--output=/etc/cron.d/x",
        "\u2014trust-remote-code",  # an em dash: no flag name, and no value of a flag before it
        "-9.trust_remote_code",  # not a negative number: argparse reads a flag, vLLM dies at launch
        "outputs/runs/1/rl/final",  # a bare value: vLLM's positional model
    ],
    "env-name": ["LD_PRELOAD", "PYTHONPATH", "ASYNCRL_SERVER_URL"],
    "split": ["../../etc", "a/b", "train\nx"],
}
"""What an attacker puts in a field of each kind (each must be refused there)."""

ENV_ARGS: list[tuple[str, Any]] = [
    ("task.rewards.r.fn", "path/to/evil.py:f"),
    ("task.rewards.r.fn", "os:system"),
    ("task.metrics.m.fn", "subprocess:run"),
    ("task.stops.s.fn", "/tmp/evil.py:f"),
    (
        "task.judges",
        [{"id": "evil", "base_url": "http://evil.example", "headers_from_env": {"x": "ASYNCRL_RUN_TOKEN"}}],
    ),
    ("system_prompt", "/etc/passwd"),
    ("max_chars", "/etc/passwd"),
    ("num_train", "os:system"),
]
"""``env.args`` of the built-in ``reverse_text`` that verifiers would read as code, a file or an address (or text where
a number is declared)."""

# ----------------------------------------------------------------------------- the declaration is complete


def text_fields(model: type[BaseModel]) -> set[str]:
    """Dotted keys of every text (``str`` or untyped) field of ``model``, nested tables and arrays included."""
    found: set[str] = set()

    def walk(ann: Any, key: str) -> None:
        origin = typing.get_origin(ann)
        if origin is typing.Annotated:
            walk(typing.get_args(ann)[0], key)
        elif isinstance(ann, type) and issubclass(ann, BaseModel):
            for name, field in ann.model_fields.items():
                walk(field.annotation, f"{key}.{name}" if key else name)
        elif origin in (typing.Union, types.UnionType):
            for arg in typing.get_args(ann):
                walk(arg, key)
        elif origin in (list, tuple, set, frozenset):
            for arg in typing.get_args(ann):
                walk(arg, f"{key}.0")
        elif origin is dict:
            walk(typing.get_args(ann)[1], f"{key}.<key>")
            found.add(f"{key}.<key>")
        elif ann is str or ann is Any:
            found.add(key)

    walk(model, "")
    return found


def test_every_text_field_is_declared() -> None:
    fields = text_fields(RLSpec) | text_fields(SFTSpec) | text_fields(EvalSpec)
    assert sorted(fields - set(TEXT_FIELDS)) == [], "declare each new text field in TEXT_FIELDS (and check it)"
    assert sorted(set(TEXT_FIELDS) - fields) == []


# ----------------------------------------------------------------------------- the routes


@dataclass
class Ctx:
    client: Any
    member: dict[str, str]
    csrf: str
    parent: int
    counts: Callable[[], tuple[int, int, int]]


def nest(dotted: str, value: Any) -> dict[str, Any]:
    """``{"a": {"b": value}}`` for ``a.b``; ``.0`` makes an array of one, ``.<key>`` a table of one key."""
    *parents, last = dotted.split(".")
    out: Any = value
    if last == "0":
        out = [value]
    elif last != "<key>":
        out = {last: value}
    for part in reversed(parents):
        out = [out] if part == "0" else {part: out}
    return dict(out)


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def base_spec(kind: str) -> dict[str, Any]:
    if kind == "sft":
        return {"kind": "sft", "name": "sft-attack", "max_steps": 2, "model": {"name": BAD_MODEL}}
    if kind == "eval":
        return {"kind": "eval", "name": "eval-attack", "model": {"name": BAD_MODEL}}
    return spec(max_steps=3)


Route = Callable[[Ctx, str, dict[str, Any]], Any]


def rest(c: Ctx, kind: str, extra: dict[str, Any]) -> Any:
    return c.client.post("/api/runs", json=merge(base_spec(kind), extra), headers=c.member)


def upload(c: Ctx, kind: str, extra: dict[str, Any]) -> Any:
    text = tomli_w.dumps(merge(base_spec(kind), extra))
    return c.client.post("/api/runs", files={"file": ("rl.toml", text.encode(), "text/plain")}, headers=c.member)


def launch_form(c: Ctx, kind: str, extra: dict[str, Any]) -> Any:
    data = {"spec": tomli_w.dumps(merge(base_spec(kind), extra)), "csrf": c.csrf}
    return c.client.post("/launch", data=data, follow_redirects=False)


def fork_api(c: Ctx, _kind: str, extra: dict[str, Any]) -> Any:
    body = {"changes": extra, "step": 2}
    return c.client.post(f"/api/runs/{c.parent}/fork", json=body, headers=c.member)


def fork_form(c: Ctx, _kind: str, extra: dict[str, Any]) -> Any:
    data = {"changes": tomli_w.dumps(extra), "step": "2", "csrf": c.csrf}
    return c.client.post(f"/runs/{c.parent}/fork", data=data, follow_redirects=False)


def sweep(c: Ctx, kind: str, extra: dict[str, Any]) -> Any:
    body = {
        "name": "attack",
        "base": merge(base_spec(kind), extra),
        "grid": {"trainer.optim.lr": [1e-4, 2e-4]},
        "metric": "eval/reward_mean",
        "mode": "max",
    }
    return c.client.post("/api/sweeps", json=body, headers=c.member)


def pipeline(c: Ctx, kind: str, extra: dict[str, Any]) -> Any:
    stage = {k: v for k, v in merge(base_spec(kind), extra).items() if k not in ("kind", "name")}
    stages = [{"kind": kind, "base": stage}]
    if kind == "eval":  # an eval stage evaluates the stage before it
        stages.insert(0, {"kind": "sft", "base": {"model": {"name": BAD_MODEL}, "max_steps": 2}})
        if "model" not in extra:  # the stage before's weights, unless the attack names a model
            stage.pop("model")
    return c.client.post("/api/pipelines", json={"name": "attack", "stages": stages}, headers=c.member)


RL_ROUTES: dict[str, Route] = {
    "rest": rest,
    "upload": upload,
    "launch-form": launch_form,
    "fork-api": fork_api,
    "fork-form": fork_form,
    "sweep": sweep,
    "pipeline": pipeline,
}
KIND_ROUTES: dict[str, dict[str, Route]] = {
    "rl": RL_ROUTES,
    "sft": {"rest": rest, "upload": upload, "launch-form": launch_form, "pipeline": pipeline},
    "eval": {"rest": rest, "pipeline": pipeline},
}


def refused(resp: Any) -> tuple[int, str]:
    """Status and one-line answer: the JSON ``detail`` or the dashboard's inline alert."""
    if resp.headers.get("content-type", "").startswith("application/json"):
        return resp.status_code, str(resp.json().get("detail"))
    import re

    m = re.search(r'role="alert"[^>]*>([^<]*)<', resp.text)
    return resp.status_code, (m.group(1).replace("&#39;", "'") if m else resp.text[:300])


# ----------------------------------------------------------------------------- the attacks


@dataclass(frozen=True)
class Case:
    kind: str
    route: str
    field: str
    """The dotted key the answer must name."""
    extra: dict[str, Any]

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.route}-{self.field}-{json.dumps(self.extra, sort_keys=True)[-40:]}"


def spec_kinds(field: str) -> list[str]:
    kinds = {"rl": text_fields(RLSpec), "sft": text_fields(SFTSpec), "eval": text_fields(EvalSpec)}
    return [k for k, fields in kinds.items() if field in fields]


def cases() -> Iterator[Case]:
    for field, what in TEXT_FIELDS.items():
        if what in ("plain", "env-args") or field == "output_dir":  # output_dir: its own refusal, one test below
            continue
        for kind in spec_kinds(field):
            for payload in PAYLOADS[what]:
                if field.endswith(".<key>"):  # a table's key is what the library reads
                    extra = nest(field.removesuffix(".<key>"), {payload: "1"})
                elif field.startswith("env.0."):  # an [[env]] table needs a name of its own
                    extra = {"env": [{"id": payload, "name": "x"}]}
                else:
                    extra = nest(field, payload)
                named = field.removesuffix(".<key>").removesuffix(".0")
                for route in KIND_ROUTES[kind]:
                    yield Case(kind, route, named, extra)
    for arg, payload in ENV_ARGS:
        for kind in ("rl", "sft", "eval"):
            for route in KIND_ROUTES[kind]:
                extra = {"env": {"id": "reverse_text", "args": nest(arg, payload)}}
                yield Case(kind, route, f"env.args.{arg.split('.')[0]}", extra)


CASES = list(cases())


@pytest.fixture(scope="module")
def ctx(client: Any) -> Iterator[Ctx]:
    from sqlalchemy import func
    from sqlmodel import Session, select

    from server.core.db import engine
    from server.models import Pipeline, Run, Sweep

    token = new_token("mallory", role="member")
    member = {"Authorization": f"Bearer {token}"}
    made = client.post("/api/runs", json=spec(max_steps=8), headers=member)
    assert made.status_code == 201, made.text
    checkpoint(made.json(), 2)

    def counts() -> tuple[int, int, int]:
        with Session(engine) as s:
            return tuple(int(s.exec(select(func.count()).select_from(m)).one()) for m in (Run, Sweep, Pipeline))  # type: ignore[return-value]

    csrf = login(client, token)
    before = counts()
    yield Ctx(client, member, csrf, made.json()["id"], counts)
    assert counts() == before, "an attack created a run, sweep or pipeline"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_member_cannot_hand_code_files_or_addresses_to_a_library(case: Case, ctx: Ctx) -> None:
    status, detail = refused(KIND_ROUTES[case.kind][case.route](ctx, case.kind, case.extra))
    assert status in (403, 422), (status, detail)
    assert case.field in detail, detail
    assert "\n" not in detail


@pytest.mark.parametrize("field", sorted(f for f in TEXT_FIELDS if f != "output_dir"))
def test_a_nul_in_any_text_field_is_refused_naming_it(field: str, ctx: Ctx) -> None:
    for kind in spec_kinds(field):
        extra = (
            nest(field.removesuffix(".<key>"), {"a\x00b": "1"}) if field.endswith("<key>") else nest(field, "a\x00b")
        )
        status, detail = refused(rest(ctx, kind, extra))
        assert status == 422, (kind, status, detail)
        assert field.removesuffix(".<key>").removesuffix(".0").split(".0.")[0] in detail, detail


def test_output_dir_is_the_services_on_every_route(ctx: Ctx) -> None:
    for kind, routes in KIND_ROUTES.items():
        for name in ("rest", "upload"):
            if name in routes:
                status, detail = refused(routes[name](ctx, kind, {"output_dir": "/etc"}))
                assert (status, detail.split(":")[0]) == (422, "output_dir"), (kind, name, detail)
