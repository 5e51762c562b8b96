from fastapi import APIRouter

from server.api.routes import alerts, config, evals, exports, metrics, pipelines, runs, sweeps

api_router = APIRouter()
api_router.include_router(runs.router)
api_router.include_router(metrics.router)
api_router.include_router(metrics.export_router)
api_router.include_router(config.router)
api_router.include_router(exports.router)
api_router.include_router(evals.router)
api_router.include_router(alerts.router)
api_router.include_router(sweeps.router)
api_router.include_router(pipelines.router)
