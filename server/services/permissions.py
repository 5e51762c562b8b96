"""Who may do what: the one authorisation check of the REST API (``server/api``) and the dashboard (``webui``).

- A viewer, or a read token (scope ``read``), only reads: every write is refused (:func:`require_write`).
- A member submits runs and adds global alert rules and webhook endpoints; a run belongs to the user that created
  it (a fork to the user that forked it), and only its owner or an admin stops, resumes, forks from, changes the
  live config, the alert rules, tags, notes or group of, exports, reports the status or metrics of it (:func:`require_run`). A global rule or a
  webhook endpoint belongs to the user that added it (:func:`require_owner`).
- An admin may do everything.
- A run token reaches only its own run, and writes to it only while the run is live: once its final status is
  recorded, a write gets 401 (:class:`RunTokenExpired`). The supervisor sends its spooled metrics and config acks
  before its final status (``worker/launchers/reporter.py``: ``Reporter.finish``), so none of them is refused.

Refusals are domain errors (``server/errors.py``: :class:`Forbidden` 403, :class:`RunTokenExpired` 401) with a
one-line message naming the owner and the action.
"""

from __future__ import annotations

from typing import Literal

from sqlmodel import Session

from server.alerts.models import AlertRuleRow, WebhookDelivery, WebhookEndpoint
from server.alerts.webhooks import NotFound
from server.models import TERMINAL, Role, Run, RunStatus
from server.services.tokens import Principal


class Forbidden(Exception):
    """The principal may not do this (403)."""


class RunTokenExpired(Exception):
    """A run token writing to a run that has ended (401)."""


RunAction = Literal["stop", "resume", "fork", "config", "delete", "alerts", "status", "metrics", "export", "annotate"]
VERBS: dict[RunAction, str] = {
    "stop": "stop it",
    "resume": "resume it",
    "fork": "fork from it",
    "config": "change its live config",
    "delete": "delete it",
    "alerts": "change its alert rules",
    "status": "report its status",
    "metrics": "write its metrics",
    "export": "export it",
    "annotate": "change its tags, notes or group",
}


def require_write(who: Principal) -> None:
    """Refuse every write of a viewer or a read token.

    Raises:
        Forbidden: ``who`` only reads.
    """
    if who.run_id is None and who.role == Role.viewer:
        raise Forbidden(f"user '{who.name}' is a viewer: viewers may only read")
    if who.read_only:
        raise Forbidden(f"token '{who.name}' is read-only: it may only read (GET)")


def check_run_access(who: Principal, run_id: int) -> None:
    """Run tokens reach only their own run (users read every run).

    Raises:
        Forbidden: a run token of another run.
    """
    if who.run_id is not None and who.run_id != run_id:
        raise Forbidden(f"this run token belongs to run {who.run_id}, not run {run_id}")


def may_change(who: Principal | None, run: Run) -> bool:
    """Whether ``who`` may change ``run`` (stop, resume, fork, live config, its alert rules): the dashboard shows its
    write forms only then."""
    if who is None or who.run_id is not None or who.read_only:
        return False
    return who.role == Role.admin or run.owner == who.name


def require_run(who: Principal, run: Run, action: RunAction) -> None:
    """``who`` may do ``action`` to ``run``: its owner or an admin; its own run token while the run is live.

    Raises:
        Forbidden: a viewer, a read token, another member, or another run's token.
        RunTokenExpired: the run's own token after the run ended.
    """
    if who.run_id is not None:
        check_run_access(who, run.id or 0)
        if RunStatus(run.status) in TERMINAL:
            raise RunTokenExpired(f"run {run.id} has ended ({run.status}): its run token no longer writes")
        return
    require_write(who)
    if not may_change(who, run):
        raise Forbidden(f"run {run.id} belongs to {run.owner}: only its owner or an admin may {VERBS[action]}")


def owns(who: Principal, owner: str) -> bool:
    """Whether ``who`` may change what ``owner`` added: that user (with a write token) or an admin. Webhook URLs are
    shown whole only then (their path may be a credential)."""
    return who.run_id is None and not who.read_only and (who.role == Role.admin or who.name == owner)


def require_owner(who: Principal, owner: str, what: str, verb: str) -> None:
    """``who`` may change ``what`` (e.g. ``"webhook endpoint 3"``), which ``owner`` added: its owner or an admin.

    Raises:
        Forbidden: a viewer, a read token, a run token, or another member.
    """
    require_write(who)
    if not owns(who, owner):
        raise Forbidden(f"{what} belongs to {owner}: only its owner or an admin may {verb}")


def require_rule(session: Session, who: Principal, rule: AlertRuleRow, verb: str) -> None:
    """``who`` may change or delete ``rule``: a run's rule (its API and spec rules) as its run (:func:`require_run`),
    a global rule as what its creator added (:func:`require_owner`).

    Raises:
        Forbidden: as :func:`require_run` / :func:`require_owner`.
    """
    run = session.get(Run, rule.run_id) if rule.run_id is not None else None
    if run is not None:
        require_run(who, run, "alerts")
    else:
        require_owner(who, rule.created_by, f"global alert rule {rule.id}", verb)


def require_endpoint(who: Principal, endpoint: WebhookEndpoint, verb: str) -> None:
    """``who`` may ``verb`` the webhook ``endpoint``: the user that added it, or an admin.

    Raises:
        Forbidden: as :func:`require_owner`.
    """
    require_owner(who, endpoint.created_by, f"webhook endpoint {endpoint.id}", verb)


def require_replay(session: Session, who: Principal, delivery_id: int) -> None:
    """``who`` may replay delivery ``delivery_id``: the user that added its endpoint, or an admin.

    Raises:
        NotFound: no such delivery.
        Forbidden: as :func:`require_owner`.
    """
    delivery = session.get(WebhookDelivery, delivery_id) if 0 < delivery_id < 2**31 else None
    endpoint = session.get(WebhookEndpoint, delivery.endpoint_id) if delivery is not None else None
    if delivery is None or endpoint is None:
        raise NotFound(f"delivery {delivery_id} not found")
    require_endpoint(who, endpoint, "replay its deliveries")
