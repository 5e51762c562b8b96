#!/usr/bin/env bash
# `docker compose --profile cpu up` in CI: deploy/compose-smoke.sh (build, the four services healthy, one short
# REST-submitted run to `completed`, its metrics in Postgres and its dashboard page, then down/up keeps them), with
# everything that can be cached kept between CI runs:
#   - the Debian base image (debootstrap, ~40 s) and the stand-in images of Python, Postgres and Redis (apt, ~1 min):
#     saved under the cache folder (docker save, ~250 MB) and loaded when the engine lacks them (a fresh engine);
#   - the server and CPU worker images: kept by the engine and not rebuilt while their build context (Dockerfiles,
#     locks, pyproject.toml, code: compose-smoke.sh's asyncrl.context label) is unchanged; when it changed, Docker's
#     layer cache keeps each image's .venv layer while the install's inputs (pyproject.toml, the locks, setup.sh) are
#     unchanged, so a change of the code rebuilds in seconds, not minutes;
#   - images of ours a rebuild left untagged are removed, and the build cache is capped (ASYNCRL_CI_BUILD_CACHE).
#
#   bash deploy/compose-ci.sh          # from the checkout root, as root (starts dockerd if absent); exit 0 = passed
#
# Needs what compose-smoke.sh needs (Debian: apt-get install docker.io debootstrap). Settings (environment):
#   ASYNCRL_CI_CACHE        cache folder              default ${XDG_CACHE_HOME:-~/.cache}/asyncrl-compose
#   ASYNCRL_CI_BUILD_CACHE  Docker build cache kept   default 30GB (docker builder prune --keep-storage)
# and compose-smoke.sh's own (ASYNCRL_SMOKE_PORT, ASYNCRL_SMOKE_LOCK, ...). Its measurements go to
# $ASYNCRL_CI_CACHE/compose_ci.json, not to the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/docker-engine.sh  # start_dockerd
CACHE=${ASYNCRL_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/asyncrl-compose}
SUITE=bookworm
STANDINS=("asyncrl-standin/debian:$SUITE" "asyncrl-standin/python:$SUITE" "asyncrl-standin/postgres:$SUITE"
  "asyncrl-standin/redis:$SUITE")
SAVED=$CACHE/standins-$SUITE.tar
mkdir -p "$CACHE"
START=$SECONDS
rc=0

# The engine first (compose-smoke.sh starts one too, but the stand-ins are loaded before it runs)
if ! docker info >/dev/null 2>&1 && command -v dockerd >/dev/null && [ "$(id -u)" = 0 ]; then
  start_dockerd "$CACHE/dockerd.log" || true
fi
docker info >/dev/null 2>&1 || { echo "compose-ci: no Docker engine (Debian: apt-get install docker.io)" >&2; exit 1; }

have_all() { for t in "${STANDINS[@]}"; do docker image inspect "$t" >/dev/null 2>&1 || return 1; done; }
if ! have_all && [ -s "$SAVED" ]; then
  t0=$SECONDS
  docker load -i "$SAVED" >/dev/null
  echo "compose-ci: stand-in images loaded from $SAVED ($((SECONDS - t0)) s)"
fi

RESULTS=${ASYNCRL_SMOKE_RESULTS:-$CACHE/compose_ci.json}
ASYNCRL_SMOKE_DIR=${ASYNCRL_SMOKE_DIR:-$CACHE/work} ASYNCRL_SMOKE_RESULTS=$RESULTS bash deploy/compose-smoke.sh || rc=$?

if have_all && [ ! -s "$SAVED" ]; then  # saved once; compose-smoke.sh never rebuilds a stand-in that is present
  docker save -o "$SAVED.tmp" "${STANDINS[@]}" && mv "$SAVED.tmp" "$SAVED"
fi
docker image prune -f --filter label=asyncrl.context >/dev/null  # our images a rebuild left untagged
docker builder prune -f --keep-storage "${ASYNCRL_CI_BUILD_CACHE:-30GB}" >/dev/null 2>&1 || true
echo "compose-ci: exit $rc in $((SECONDS - START)) s (measurements: $RESULTS)"
exit "$rc"
