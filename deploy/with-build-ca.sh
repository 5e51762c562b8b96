#!/usr/bin/env bash
# Runs "$@" (a build step of deploy/Dockerfile.*) trusting the CA bundle of the optional build secret ca_bundle:
#   docker build --secret id=ca_bundle,src=/etc/ssl/certs/ca-certificates.crt ...
# for builds behind a TLS-inspecting proxy. The secret is mounted for that step only, never written to a layer;
# without it "$@" runs with the image's own CA store.
set -euo pipefail
bundle=/run/secrets/ca_bundle
if [ -s "$bundle" ]; then
  export PIP_CERT=$bundle NODE_EXTRA_CA_CERTS=$bundle npm_config_cafile=$bundle REQUESTS_CA_BUNDLE=$bundle
fi
exec "$@"
