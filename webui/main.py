"""The dashboard's router: every page module's routes, mounted by ``server/main.py`` beside ``/api``.

Pages (one module each, over ``server/services`` and ``server/alerts``): ``site`` (static files, login),
``run_list`` (/runs), ``launch`` (/launch), ``run_page`` (/runs/{id}), ``compare`` (/compare), ``alerts``
(/alerts), ``sweeps`` (/sweeps, /sweeps/{id}), ``pipelines`` (/pipelines, /pipelines/{id}), ``rollouts`` (/runs/{id}/rollouts, /rollouts/compare), ``lineage`` (/runs/{id}/lineage). Shared: ``page`` (templates, the request's ``Page``, dependencies), ``errors`` (HTML error pages),
``auth`` (cookie session, CSRF), ``figures`` (Plotly JSON).
"""

from __future__ import annotations

from fastapi import APIRouter

from webui import alerts, compare, launch, lineage, pipelines, rollouts, run_list, run_page, site, sweeps

router = APIRouter(include_in_schema=False)
for module in (site, run_list, launch, run_page, lineage, rollouts, compare, alerts, sweeps, pipelines):
    router.include_router(module.router)
