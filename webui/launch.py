"""The launch page (``/launch``): pick a config under ``configs/`` or paste a TOML spec; the run is validated
by the same service as ``POST /api/runs`` (``runs.create``) and its errors are shown at the offending line."""

from __future__ import annotations

import re
import tomllib

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, Response

from server.errors import nul_error, spec_too_large
from server.jobs.celery_app import BrokerUnavailable
from server.models import Role, stored_id
from server.services import permissions, runs, spec_policy
from webui.errors import HTMLErrorRoute
from webui.page import HERE, FormDep, Page, SessionDep, page
from worker.spec import SpecError, parse_text
from worker.spec.loading import MAX_SPEC_BYTES

CONFIGS = HERE.parent / "configs"
router = APIRouter(include_in_schema=False, route_class=HTMLErrorRoute)


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
    permissions.require_write(p.need_user())  # a viewer gets a 403 page, not a form whose POST is refused
    text = ""
    if config:
        if config not in config_files():
            raise HTTPException(404, f"config: no {config!r} under configs/ (have: {', '.join(config_files())})")
        text = (CONFIGS / config).read_text()
    return _launch_page(p, text, config)


@router.post("/launch")
def launch(request: Request, db: SessionDep, form: FormDep) -> Response:
    """Parse the pasted TOML, validate it with the API's spec validation (``runs.create``), queue the run and go to
    its page; errors come back inline at the offending line."""
    p = page(request, db)
    p.form(form)
    text, chosen = str(form.get("spec", "")), str(form.get("config", ""))
    if len(text.encode()) > MAX_SPEC_BYTES:
        return _launch_page(p, text, chosen, 413, spec_too_large("spec"))
    try:
        data = parse_text(text, "TOML")
    except tomllib.TOMLDecodeError as err:
        return _launch_page(p, text, chosen, 422, f"TOML: {err}", error_line(text, err))
    except SpecError as err:  # nested deeper than the spec allows
        return _launch_page(p, text, chosen, 422, str(err))
    if isinstance(data, dict) and (nul := nul_error(data)) is not None:  # a TOML "\u0000"
        return _launch_page(p, text, chosen, 422, nul)
    try:
        who = p.need_user()
        spec_policy.check_submitted(data)
        run = runs.create(db, data=data, owner=who.name, admin=who.role == Role.admin)
    except SpecError as err:
        db.rollback()
        line = error_line(text, err)
        return _launch_page(p, text, chosen, 422, f"{err} (line {line})" if line else str(err), line)
    db.commit()
    try:
        runs.enqueue_launch(db, stored_id(run))
    except BrokerUnavailable as err:  # the run is failed with the reason: say so on the form, the spec kept
        return _launch_page(p, text, chosen, 503, str(err))
    return p.redirect(f"/runs/{stored_id(run)}")
