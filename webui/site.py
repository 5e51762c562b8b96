"""Site-wide dashboard routes: static files (pinned htmx and Swagger UI, Plotly's bundle, the dashboard's own JS and CSS), the
home redirect, login with an API token and logout (which ends the session on the server)."""

from __future__ import annotations

from pathlib import Path

import plotly
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from server.services import tokens
from webui import auth
from webui.errors import HTMLErrorRoute
from webui.page import HERE, FormDep, SessionDep, page

HTMX_VERSION = "2.0.8"
"""Pinned in scripts/setup.sh, which unpacks it from the npm package into static/vendor."""
SWAGGER_UI_VERSION = "5.35.0"
"""Pinned in scripts/setup.sh, which unpacks its bundle, CSS and icon from the npm package into static/vendor."""
SWAGGER_UI = HERE / "static" / "vendor" / f"swagger-ui-{SWAGGER_UI_VERSION}"
STATIC = {
    "htmx.js": HERE / "static" / "vendor" / f"htmx-{HTMX_VERSION}.min.js",
    "swagger-ui-bundle.js": SWAGGER_UI / "swagger-ui-bundle.js",  # the API docs (/docs: server/main.py)
    "swagger-ui.css": SWAGGER_UI / "swagger-ui.css",
    "swagger-ui-favicon.png": SWAGGER_UI / "favicon-32x32.png",
    "plotly.js": Path(plotly.__file__).parent / "package_data" / "plotly.min.js",  # the bundle the package ships
    "dashboard.js": HERE / "static" / "dashboard.js",
    "dashboard.css": HERE / "static" / "dashboard.css",
}

router = APIRouter(include_in_schema=False, route_class=HTMLErrorRoute)


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
def login(request: Request, db: SessionDep, form: FormDep) -> Response:
    """Log in with an API token. A bad token (unknown, revoked, a run token) is 401 with the login form again,
    whatever the form's CSRF token (it starts nothing); a good one with a missing or wrong CSRF token is 403 (no
    session is stored: login CSRF)."""
    p = page(request, db)
    token, target = str(form.get("token", "")).strip(), _safe_next(str(form.get("next", "")))
    try:
        _, sid = tokens.start_session(db, token, max_age_s=auth.MAX_AGE_S)
    except tokens.AuthError as err:
        db.rollback()
        return p.render("login.html", code=401, next=target, error=f"token: {err}")
    p.form(form, write=False)  # raises 403 before the commit: the session row flushed above is rolled back
    db.commit()
    if p.web.sid:  # logging in again over a live session ends that one
        tokens.end_session(db, p.web.sid)
        db.commit()
    p.web = auth.WebSession(sid=sid)  # a new CSRF token with the new identity
    return p.redirect(target)


@router.post("/logout")
def logout(request: Request, db: SessionDep, form: FormDep) -> Response:
    p = page(request, db)
    p.form(form, write=False)
    if p.web.sid:  # the session ends on the server: the same cookie, replayed, gets the login page
        tokens.end_session(db, p.web.sid)
        db.commit()
    p.web = auth.WebSession()
    return p.redirect("/login")
