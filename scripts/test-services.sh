#!/usr/bin/env bash
# Start what the tests talk to (idempotent; run as root on a Debian machine): Postgres and Redis (started if down),
# Debian's headless Chromium for the dashboard's browser tests (Playwright never downloads a browser), Debian's
# Prometheus for the scrape test, and a real single-node Slurm (munge, slurmctld, slurmd) for the Slurm launcher's
# tests, and a multi-node one beside it; and the venv's Python usable by the runs' uids (scripts/python-for-runs.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# The runs the tests launch as a root worker run as other uids (worker/launchers/supervisor.py run_user): they must reach .venv's
# Python (e.g. through /root, 0700).
bash scripts/python-for-runs.sh

if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
fi
if ! redis-cli -h 127.0.0.1 ping >/dev/null 2>&1; then
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
if ! command -v chromium >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q chromium >/dev/null
fi
if ! command -v prometheus >/dev/null; then  # Debian's Prometheus scrapes the server in tests/service/test_prometheus.py
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends prometheus >/dev/null
fi
if [ -f ../shared/slurm/local-cluster.sh ]; then bash ../shared/slurm/local-cluster.sh start
else bash deploy/slurm/local-cluster.sh start; fi
# the multi-node cluster (3 slurmd in their own network namespaces; clients use SLURM_CONF=/etc/slurm-multi/slurm.conf)
bash deploy/slurm/multi-node-cluster.sh start
