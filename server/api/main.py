from fastapi import APIRouter

from server.api.routes import alerts, config, exports, metrics, runs

api_router = APIRouter()
api_router.include_router(runs.router)
api_router.include_router(metrics.router)
api_router.include_router(config.router)
api_router.include_router(exports.router)
api_router.include_router(alerts.router)
