"""Dashboard pages (server-rendered Jinja2 + htmx): login, runs list, launch, run page, compare.

Every page works as a plain GET; htmx only refreshes fragments (``?part=…`` or the ``HX-Request`` header).
Writes are POST forms with the session's CSRF token and call the same functions as the REST API.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode, urlsplit

import plotly
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.routing import APIRoute
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError
from sqlmodel import Session
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.deps import SessionDep
from server.api.routes import config as config_api
from server.api.routes import runs as runs_api
from server.core.db import engine
from server.errors import DOMAIN_ERRORS, http_status
from server.models import TERMINAL, ForkRequest, Run, RunStatus, utcnow
from server.services import config, metrics, runs, tokens
from server.services.runs import InvalidTransition, RunNotFound
from server.services.tokens import Principal
from webui import auth, figures
from worker.celery_app import TaskName, enqueue
from worker.dotted_keys import flatten, replay
from worker.live_config import LIVE_KEYS, validate_changes
from worker.spec import SpecError, parse_override_value

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent / "configs"
HTMX_VERSION = "2.0.8"
"""Pinned in scripts/setup.sh, which unpacks it from the npm package into static/vendor."""
STATIC = {
    "htmx.js": HERE / "static" / "vendor" / f"htmx-{HTMX_VERSION}.min.js",
    "plotly.js": Path(plotly.__file__).parent / "package_data" / "plotly.min.js",  # the bundle the package ships
    "dashboard.js": HERE / "static" / "dashboard.js",
    "dashboard.css": HERE / "static" / "dashboard.css",
}
POLL_S = 3
"""Seconds between live updates of a page's fragments."""

templates = Jinja2Templates(directory=HERE / "templates")


def age(when: datetime) -> str:
    """How long ago ``when`` was, coarse: ``42s``, ``7m``, ``3h``, ``2d``."""
    s = max(0, int((utcnow() - when).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


templates.env.filters["age"] = age


def figures_json(figs: dict[str, Any]) -> str:
    """Figures as JSON safe inside ``<script type="application/json">`` (no ``</`` can end the element)."""
    return json.dumps(figs, allow_nan=False, default=str).replace("</", "<\\/")


# ----------------------------------------------------------------------------- error pages


def wants_html(request: Request) -> bool:
    """True for a browser navigation or form post (``Accept`` names ``text/html``), not for htmx fragment
    requests or API clients."""
    return "text/html" in request.headers.get("accept", "") and not _is_fragment(request)


def _back(request: Request) -> str:
    """Where the error page links back to: the referring page of this site, else the runs list."""
    referer = urlsplit(request.headers.get("referer", ""))
    if referer.netloc == request.url.netloc and referer.path.startswith("/") and referer.path != request.url.path:
        return referer.path + (f"?{referer.query}" if referer.query else "")
    return "/runs"


def error_status(err: Exception) -> tuple[int, str, dict[str, str] | None]:
    """(status, one-line message, headers) of an error a dashboard route raised, as the JSON API reports it."""
    if isinstance(err, StarletteHTTPException):
        return err.status_code, str(err.detail), err.headers
    if isinstance(err, RequestValidationError):
        first = err.errors()[0]
        return 422, f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}", None
    return http_status(err) or 500, str(err), None


def error_page(request: Request, code: int, message: str, headers: dict[str, str] | None = None) -> HTMLResponse:
    """The site's layout with the one-line ``message`` and a link back (status ``code``)."""
    web = auth.load(request)
    with Session(engine) as db:
        user = auth.principal(db, web)
    resp = templates.TemplateResponse(
        request,
        "error.html",
        {"user": user, "csrf": web.csrf, "poll_s": POLL_S, "code": code, "message": message, "back": _back(request)},
        status_code=code,
        headers=headers,
    )
    web.save(resp)
    return resp


class HTMLErrorRoute(APIRoute):
    """A dashboard route whose 4xx errors reach a browser as an HTML page in the site's layout; other clients
    (the TestClient, curl, htmx fragments) keep the API's JSON ``{"detail": …}``."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)  # type: ignore[no-any-return]
            except (StarletteHTTPException, RequestValidationError, *DOMAIN_ERRORS) as err:
                code, message, headers = error_status(err)
                if code < 400 or not wants_html(request):
                    raise
                return error_page(request, code, message, headers)

        return route


router = APIRouter(include_in_schema=False, route_class=HTMLErrorRoute)


@dataclass
class Page:
    request: Request
    db: Any
    web: auth.WebSession
    user: Principal | None

    def render(self, name: str, code: int = 200, **values: Any) -> HTMLResponse:
        resp = templates.TemplateResponse(
            self.request, name, {"user": self.user, "csrf": self.web.csrf, "poll_s": POLL_S, **values}, status_code=code
        )
        self.web.save(resp)
        return resp

    def redirect(self, url: str) -> RedirectResponse:
        resp = RedirectResponse(url, status_code=303)
        self.web.save(resp)
        return resp

    def need_user(self) -> Principal:
        """The logged-in principal; otherwise a 303 to the login page (which returns here afterwards)."""
        if self.user is None:
            target = self.request.url.path + (f"?{self.request.url.query}" if self.request.url.query else "")
            raise HTTPException(303, "log in first", headers={"Location": "/login?" + urlencode({"next": target})})
        return self.user

    async def form(self, *, write: bool = True) -> Any:
        """The POSTed form after the CSRF check (and, for ``write``, the write-scope check). Raises 403."""
        form = await self.request.form()
        auth.check_csrf(self.web, form)
        if write:
            auth.check_write(self.need_user())
        return form


def page(request: Request, db: SessionDep) -> Page:
    web = auth.load(request)
    return Page(request, db, web, auth.principal(db, web))


def _is_fragment(request: Request) -> bool:
    return request.headers.get("hx-request") == "true"


# ----------------------------------------------------------------------------- static, login


@router.get("/static/{name}")
def static(name: str) -> FileResponse:
    path = STATIC.get(name)
    if path is None or not path.is_file():
        raise HTTPException(404, f"static: no file {name!r}" + (" (run scripts/setup.sh)" if path else ""))
    return FileResponse(path, headers={"Cache-Control": "max-age=3600"})


@router.get("/")
def home() -> RedirectResponse:
    return RedirectResponse("/runs", status_code=303)


def _safe_next(target: str | None) -> str:
    return target if target and target.startswith("/") and not target.startswith("//") else "/runs"


@router.get("/login", response_class=HTMLResponse)
def login_page(request: Request, db: SessionDep, next: str | None = None) -> HTMLResponse:
    return page(request, db).render("login.html", next=_safe_next(next))


@router.post("/login")
async def login(request: Request, db: SessionDep) -> Response:
    p = page(request, db)
    form = await p.form(write=False)
    token, target = str(form.get("token", "")).strip(), _safe_next(str(form.get("next", "")))
    try:
        who = tokens.authenticate(db, token)
        if who.run_id is not None:
            raise tokens.AuthError("a run token cannot log in; use a user token (asyncrl token create)")
    except tokens.AuthError as err:
        return p.render("login.html", code=401, next=target, error=f"token: {err}")
    p.web = auth.WebSession(token=tokens.hash_token(token))  # a new CSRF token with the new identity
    return p.redirect(target)


@router.post("/logout")
async def logout(request: Request, db: SessionDep) -> Response:
    p = page(request, db)
    await p.form(write=False)
    p.web = auth.WebSession()
    return p.redirect("/login")


# ----------------------------------------------------------------------------- runs list


@router.get("/runs", response_class=HTMLResponse)
def runs_page(request: Request, db: SessionDep, status: str = "", q: str = "") -> HTMLResponse:
    p = page(request, db)
    p.need_user()
    if status and status not in RunStatus.__members__:
        raise HTTPException(422, f"status: expected one of {', '.join(RunStatus)}, got {status!r}")
    rows, total = runs.list_runs(db, status=RunStatus(status) if status else None, name=q or None, limit=200)
    reward = metrics.latest(db, run_ids=[r.id for r in rows], source="orchestrator", name="reward_mean")  # type: ignore[misc]
    query = urlencode({"status": status, "q": q})
    name = "_runs_table.html" if _is_fragment(request) else "runs.html"
    return p.render(
        name, runs=rows, total=total, reward=reward, status=status, q=q, query=query, statuses=list(RunStatus)
    )


# ----------------------------------------------------------------------------- launch


def config_files() -> list[str]:
    """TOML run specs under ``configs/``, as paths relative to it."""
    return sorted(str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.toml"))


_TABLE = re.compile(r"^\[\s*([^\[\]]+?)\s*\]$")


def key_line(toml_text: str, dotted: str) -> int | None:
    """The 1-based line of ``toml_text`` that sets ``dotted`` (or the table holding it, or its nearest table),
    None when no line does (e.g. a missing required key at the top level)."""
    table, best, best_len = "", None, -1
    for number, raw in enumerate(toml_text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if m := _TABLE.match(line):
            table = m.group(1).replace(" ", "").replace('"', "")
            full = table
        elif "=" in line:
            key = re.sub(r"\s*\.\s*", ".", line.split("=", 1)[0].strip().replace('"', ""))
            full = f"{table}.{key}" if table else key
        else:
            continue
        if full == dotted or dotted.startswith(full + "."):
            if len(full) > best_len or (full == dotted):
                best, best_len = number, len(full)
            if full == dotted:
                return number
    return best


_TOML_AT = re.compile(r"\(at line (\d+), column \d+\)")
_UNKNOWN_KEY = re.compile(r"^unknown key '([^']+)'")


def error_line(toml_text: str, error: SpecError | tomllib.TOMLDecodeError) -> int | None:
    """The 1-based line of ``toml_text`` an error of the pasted spec points at: the position a TOML syntax error
    names (``… (at line 3, column 5)``; the last line for ``… (at end of document)``), the key an unknown-key
    error names (``unknown key 'trainer.optim.lrr' (did you mean …)``) or the key before the first ``:`` of a
    validation error; None when no line does."""
    message = str(error)
    if isinstance(error, tomllib.TOMLDecodeError):
        lineno = getattr(error, "lineno", None)  # Python >= 3.14; older ones only say it in the message
        if lineno is None and (found := _TOML_AT.search(message)):
            lineno = int(found.group(1))
        if lineno is None and message.endswith("(at end of document)"):
            lineno = len(toml_text.splitlines()) or None
        return lineno
    unknown = _UNKNOWN_KEY.match(message)
    return key_line(toml_text, unknown.group(1) if unknown else message.split(":", 1)[0].strip())


def _launch_page(
    p: Page, text: str, chosen: str, status: int = 200, error: str | None = None, line: int | None = None
) -> HTMLResponse:
    return p.render(
        "launch.html",
        code=status,
        configs=config_files(),
        chosen=chosen,
        text=text,
        spec_error=error,
        error_line=line,
        lines=text.splitlines(),
    )


@router.get("/launch", response_class=HTMLResponse)
def launch_page(request: Request, db: SessionDep, config: str = "") -> HTMLResponse:
    p = page(request, db)
    auth.check_write(p.need_user())  # a read token gets a 403 page, not a form whose POST is refused
    text = ""
    if config:
        if config not in config_files():
            raise HTTPException(404, f"config: no {config!r} under configs/ (have: {', '.join(config_files())})")
        text = (CONFIGS / config).read_text()
    return _launch_page(p, text, config)


@router.post("/launch")
async def launch(request: Request, db: SessionDep) -> Response:
    """Parse the pasted TOML, validate it with the API's spec validation (``runs.create``), queue the run and go to
    its page; errors come back inline at the offending line."""
    p = page(request, db)
    form = await p.form()
    text, chosen = str(form.get("spec", "")), str(form.get("config", ""))
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        return _launch_page(p, text, chosen, 422, f"TOML: {err}", error_line(text, err))
    try:
        run = runs.create(db, data=data, owner=p.need_user().name)
    except SpecError as err:
        db.rollback()
        line = error_line(text, err)
        return _launch_page(p, text, chosen, 422, f"{err} (line {line})" if line else str(err), line)
    db.commit()
    enqueue(TaskName.launch_run, run.id)  # type: ignore[arg-type]
    return p.redirect(f"/runs/{run.id}")


# ----------------------------------------------------------------------------- run page


def _run(db: Any, run_id: int) -> Run:
    try:
        return runs.get(db, run_id)
    except RunNotFound as err:
        raise HTTPException(404, str(err)) from None


def _events(db: Any, run_id: int, last: int = 100) -> list[Any]:
    _, total = runs.events(db, run_id, limit=1)
    rows, _ = runs.events(db, run_id, offset=max(0, total - last), limit=last)
    return rows[::-1]


def _logs(run: Run, process: str, lines: int = 40) -> list[str]:
    try:
        return runs.tail(runs.log_path(run, process), lines)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return []


def run_context(db: Any, run: Run, process: str = "trainer", part: str = "") -> dict[str, Any]:
    """What the run page (``part`` empty) or one of its fragments shows, computed once per request."""
    revisions, values = config.current(db, run)
    ctx: dict[str, Any] = {
        "run": run,
        "live": RunStatus(run.status) not in TERMINAL,
        "values": values,
        "revisions": revisions,
        "live_keys": LIVE_KEYS,
        "process": process,
        "resumable": RunStatus(run.status) in runs.RESUMABLE,
        "charts": [*figures.CHARTS],
    }
    if part in ("", "charts"):
        marks = figures.revision_marks(revisions)
        series = figures.load_series(db, run.id)  # type: ignore[arg-type]
        bn = figures.bottleneck(series)
        figs = figures.run_figures(series, marks)
        figs["bottleneck"] = figures.bottleneck_figure(bn, marks)
        ctx.update(figures_json=figures_json(figs), bottleneck=bn)
    if part in ("", "events"):
        ctx["events"] = _events(db, run.id)  # type: ignore[arg-type]
    if part in ("", "rollouts"):
        ctx["rollout_step"], ctx["rollouts"] = runs.rollouts(run, limit=16)
    if part in ("", "logs"):
        ctx.update(processes=runs.LOG_PROCESSES, logs=_logs(run, process))
    return ctx


PARTS = {
    "status": "_run_status.html",
    "charts": "_run_charts.html",
    "events": "_run_events.html",
    "rollouts": "_run_rollouts.html",
    "logs": "_run_logs.html",
}


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, db: SessionDep, run_id: int, part: str = "", process: str = "trainer") -> HTMLResponse:
    """The run page, or one live fragment of it (``part``: status, charts, events, rollouts, logs)."""
    p = page(request, db)
    p.need_user()
    if process not in runs.LOG_PROCESSES:
        raise HTTPException(422, f"process: expected one of {', '.join(runs.LOG_PROCESSES)}, got {process!r}")
    if part and part not in PARTS:
        raise HTTPException(422, f"part: expected one of {', '.join(PARTS)}, got {part!r}")
    ctx = run_context(db, _run(db, run_id), process, part)
    return p.render(PARTS[part] if part else "run.html", **ctx)


async def _act(p: Page, run_id: int, action: Any) -> Response:
    """Run a write ``action(user)``; its one-line error (409/422) is shown on the run page."""
    user = p.need_user()
    try:
        target = action(user)
    except (InvalidTransition, SpecError) as err:
        p.db.rollback()
        return p.render("run.html", code=error_status(err)[0], error=str(err), **run_context(p.db, _run(p.db, run_id)))
    return p.redirect(f"/runs/{target}")


@router.post("/runs/{run_id}/stop")
async def stop(request: Request, db: SessionDep, run_id: int) -> Response:
    p = page(request, db)
    await p.form()
    return await _act(p, run_id, lambda user: runs_api.stop_run(run_id, db, user).id)


@router.post("/runs/{run_id}/resume")
async def resume(request: Request, db: SessionDep, run_id: int) -> Response:
    p = page(request, db)
    await p.form()
    return await _act(p, run_id, lambda user: runs_api.resume_run(run_id, db, user).id)


@router.post("/runs/{run_id}/fork")
async def fork(request: Request, db: SessionDep, run_id: int) -> Response:
    """Fork from a checkpoint; ``changes`` is TOML with dotted keys (``trainer.optim.lr = 5e-5``)."""
    p = page(request, db)
    form = await p.form()

    def action(user: Principal) -> int:
        try:
            changes = flatten(tomllib.loads(str(form.get("changes", ""))))
        except tomllib.TOMLDecodeError as err:
            raise SpecError(f"changes: not valid TOML ({err})") from None
        step, name = str(form.get("step", "")).strip(), str(form.get("name", "")).strip()
        if step and not (step.isascii() and step.isdigit()):  # "²".isdigit() is True, int("²") fails
            raise SpecError(f"step: expected a checkpoint step (a whole number), got {step!r}")
        try:
            body = ForkRequest(changes=changes, step=int(step) if step else None, name=name or None)
        except ValidationError as err:
            first = err.errors()[0]
            raise SpecError(f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None
        return runs_api.fork_run(run_id, body, db, user).id  # type: ignore[no-any-return]

    return await _act(p, run_id, action)


@router.post("/runs/{run_id}/config")
async def change_config(request: Request, db: SessionDep, run_id: int) -> Response:
    """Live config edit in two steps: the submitted values are validated and shown as a diff against the current
    values; the confirm form (``confirm=1``) applies them through the same function as ``PATCH …/config``."""
    p = page(request, db)
    form = await p.form()
    user = p.need_user()
    run = _run(db, run_id)
    revisions, current = config.current(db, run)
    changes = {}
    for key in LIVE_KEYS:
        raw = str(form.get(key, "")).strip()
        if raw:
            value = parse_override_value(raw)
            if value != current[key]:
                changes[key] = value
    ctx = run_context(db, run)
    if not changes:
        return p.render("run.html", code=422, error="config: no value differs from the current one", **ctx)
    spec = replay(run.spec, (rev.changes for rev in revisions))
    try:
        normalised = validate_changes(spec, changes)
        if form.get("confirm") == "1":
            config_api.change_config(run_id, config_api.ConfigChange(changes=normalised), db, user)
            return p.redirect(f"/runs/{run_id}")
    except (SpecError, InvalidTransition) as err:
        db.rollback()
        key = str(err).split(":", 1)[0]
        return p.render("run.html", code=error_status(err)[0], config_error=(key, str(err)), submitted=changes, **ctx)
    diff = [(k, current[k], v) for k, v in normalised.items()]
    return p.render("run.html", diff=diff, **ctx)


# ----------------------------------------------------------------------------- compare


@router.get("/compare", response_class=HTMLResponse)
def compare(request: Request, db: SessionDep, run: Annotated[list[int] | None, Query()] = None) -> HTMLResponse:
    """Overlaid charts of the chosen runs and a table of the spec keys whose values differ."""
    p = page(request, db)
    p.need_user()
    chosen = [_run(db, i) for i in dict.fromkeys(run or [])]
    recent, _ = runs.list_runs(db, limit=100)
    ctx: dict[str, Any] = {"recent": recent, "chosen": chosen, "chosen_ids": {r.id for r in chosen}}
    if len(chosen) >= 2:
        labelled = [(f"#{r.id} {r.name}", figures.load_series(db, r.id)) for r in chosen]  # type: ignore[arg-type]
        ctx["figures_json"] = figures_json(figures.compare_figures(labelled))
        ctx["charts"] = list(figures.CHARTS)
        flat = [flatten({k: v for k, v in r.spec.items() if k != "output_dir"}) for r in chosen]
        keys = sorted(set().union(*flat))
        ctx["diff"] = [
            (k, [f.get(k, "—") for f in flat])
            for k in keys
            if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1
        ]
    return p.render("compare.html", **ctx)
