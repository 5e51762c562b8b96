"""Service settings, read from the environment (and ``.env``) once, at import.

Without ``DATABASE_URL`` / ``CELERY_BROKER_URL`` the service runs embedded: an SQLite file and a
file-backed Celery transport under ``ASYNCRL_HOME`` (default ``~/.asyncrl``), so one machine needs no
services. With them (CI, compose, cluster) it uses Postgres and Redis.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=".env", extra="ignore")

    ASYNCRL_HOME: Path = Path("~/.asyncrl").expanduser()
    """Embedded-mode state: the SQLite database, the broker folder and the generated secret."""
    DATABASE_URL: str = ""
    """SQLAlchemy URL, e.g. ``postgresql+psycopg://user@host:5432/asyncrl``; empty = SQLite in ASYNCRL_HOME."""
    CELERY_BROKER_URL: str = ""
    """e.g. ``redis://127.0.0.1:6379/0``; empty = a file-backed transport in ASYNCRL_HOME (no Redis)."""
    CELERY_QUEUE: str = "asyncrl"
    """Queue the server enqueues to and the worker consumes."""
    CELERY_VISIBILITY_TIMEOUT_S: int = Field(4 * 3600, ge=60)
    """Redis redelivers an unacked task after this long; keep it above the longest task (launch: ~1 s)."""
    ASYNCRL_OUTPUT_DIR: Path = Path("outputs")
    """Run directories of service-launched runs go to ``<ASYNCRL_OUTPUT_DIR>/runs/<id>/<name>``."""
    ASYNCRL_SERVER_URL: str = "http://127.0.0.1:8000"
    """Base URL the run processes use to reach this server."""
    SECRET_KEY: str = ""
    """Derives per-run tokens (HMAC); empty = generated once into ASYNCRL_HOME/secret_key."""
    MAX_BODY_BYTES: int = Field(8 * 1024 * 1024, ge=1024)
    """Larger request bodies are refused with 413."""
    MAX_METRIC_POINTS: int = Field(20_000, ge=1)
    """Points per ``POST /api/runs/{id}/metrics`` batch."""
    RECONCILE_INTERVAL_S: float = Field(30.0, ge=1.0)
    """Celery beat runs ``asyncrl.reconcile`` (fail runs whose supervisor died) this often."""

    @model_validator(mode="after")
    def _embedded_defaults(self) -> Settings:
        if not self.DATABASE_URL:
            self.DATABASE_URL = f"sqlite:///{self.ASYNCRL_HOME / 'asyncrl.db'}"
        if not self.CELERY_BROKER_URL:
            self.CELERY_BROKER_URL = "filesystem://"
        return self

    @property
    def embedded_broker(self) -> bool:
        return self.CELERY_BROKER_URL == "filesystem://"

    def secret_key(self) -> str:
        """SECRET_KEY, or the one generated into ASYNCRL_HOME on first use (mode 0600)."""
        if self.SECRET_KEY:
            return self.SECRET_KEY
        path = self.ASYNCRL_HOME / "secret_key"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600)
            path.write_text(secrets.token_hex(32))
        return path.read_text().strip()


settings = Settings()
