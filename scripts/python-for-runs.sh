#!/usr/bin/env bash
# A root worker runs each run as an unprivileged uid (worker/launchers/supervisor.py run_user; checked before each launch): that
# uid must be able to run this checkout's venv Python. Let other users pass through (o+x: enter, not list) the folders
# in its way, e.g. /root (0700) above a pyenv Python, saying so. Idempotent; nothing to do unless run as root.
# Called by scripts/setup.sh and scripts/test-services.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] && [ -x .venv/bin/python ] || exit 0
base=$(.venv/bin/python -c 'import sys; print(sys.base_prefix)')
for target in "$PWD/.venv/bin/python" "$(readlink -f .venv/bin/python)" "$base/lib/x"; do
  d=$(dirname "$target")
  while [ "$d" != / ]; do
    if [ $((0$(stat -c %a "$d") & 1)) = 0 ]; then
      chmod o+x "$d"
      echo "python-for-runs: chmod o+x $d (runs of a root worker run as other uids: they must reach $target)"
    fi
    d=$(dirname "$d")
  done
done
