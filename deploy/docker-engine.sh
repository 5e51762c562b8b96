# Sourced by the deploy scripts (from the checkout's root).
#
# start_dockerd LOG: start Docker's engine detached and without the calling shell's open files (under
# `flock LOCK bash deploy/<script>` an inherited descriptor of LOCK would keep the lock held for as long as dockerd
# runs, after the script has ended), its output to LOG; then wait up to 60 s for it to answer. Status 1 if it did not.
start_dockerd() {
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      if [ "$fd" -gt 2 ] && [ "$fd" != 255 ]; then eval "exec $fd>&-"; fi
    done
    cd / && exec setsid nohup dockerd </dev/null
  ) >"$1" 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && return 0; sleep 1; done
  return 1
}

# buildkit_build: set the array BUILD to an image build command with BuildKit (build secrets, cache mounts): buildx
# where installed, else a client with BuildKit built in (Debian's docker.io 20.10 client, /usr/bin/docker).
# Status 1 if there is neither.
buildkit_build() {
  if docker buildx version >/dev/null 2>&1; then
    BUILD=(docker buildx build --load)
  elif [ -x /usr/bin/docker ] && /usr/bin/docker version -f '{{.Client.Version}}' 2>/dev/null | grep -q '^20\.'; then
    BUILD=(env DOCKER_BUILDKIT=1 /usr/bin/docker build)
  else
    return 1
  fi
}
