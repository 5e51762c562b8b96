#!/bin/bash
# A real multi-node Slurm cluster on this one machine, for the multi-node tests and CI: slurmctld plus NODES slurmd
# (default 3), each slurmd in its own network namespace (own address on a private test subnet, own hostname in its
# own UTS namespace, its own Slurm node name), all sharing the filesystem as cluster nodes share NFS.
#
#   bridge asrl-br0 10.77.0.1/24 (this namespace: slurmctld, sbatch/squeue/scancel, the API server)
#     veth asrl-vK <-> eth0 in namespace asrl-nK, address 10.77.0.(10+K)/24, hostname and NodeName asrl-nK
#
# Nothing is routed or NATed out of the subnet: all traffic stays on the bridge, inside the namespaces and on loopback;
# slurmctld listens on the bridge address only, not on every interface of the machine (CommunicationParameters=
# NoCtldInAddrAny binds it to what its hostname resolves to: it runs with hostname asrl-ctl in its own UTS namespace,
# with $CONF_DIR/hosts over /etc/hosts, where asrl-ctl is 10.77.0.1); each slurmd has only its namespace's interfaces.
# It is a second cluster beside the single-node one of local-cluster.sh (own config /etc/slurm-multi/slurm.conf,
# ports 6917/6918, state, pid and log files; munged is shared): clients reach it with
#   export SLURM_CONF=/etc/slurm-multi/slurm.conf
# Names resolve inside the namespaces through /etc/netns/asrl-nK/hosts (bind-mounted over /etc/hosts there).
# Debian bookworm packages, Slurm 22.05; run as root. Idempotent: start twice is one cluster, stop twice is no error;
# stop also removes the namespaces, veths, bridge and hosts files.
# Usage: bash multi-node-cluster.sh [start|stop|status]
set -euo pipefail
cmd="${1:-start}"
NODES=${ASYNCRL_SLURM_NODES:-3}
PREFIX=asrl
BRIDGE=$PREFIX-br0
NET=10.77.0
CONF_DIR=/etc/slurm-multi
CONF=$CONF_DIR/slurm.conf
export SLURM_CONF=$CONF

node() { echo "$PREFIX-n$1"; }
addr() { echo "$NET.$((10 + $1))"; }

install() {
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null
  fi
}

network() {
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  [[ $(ip addr show dev "$BRIDGE") == *"inet $NET.1/24"* ]] || ip addr add "$NET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  # a bridge's frames pass iptables' FORWARD chain once br_netfilter is loaded (Docker loads it and sets the chain's
  # policy to DROP): let the nodes reach each other on their own bridge, nothing else
  if command -v iptables >/dev/null && [ "$(cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null)" = 1 ]; then
    iptables -C FORWARD -i "$BRIDGE" -o "$BRIDGE" -j ACCEPT 2>/dev/null \
      || iptables -I FORWARD -i "$BRIDGE" -o "$BRIDGE" -j ACCEPT
  fi
  local k ns
  for k in $(seq 1 "$NODES"); do
    ns=$(node "$k")
    [ -e "/run/netns/$ns" ] || ip netns add "$ns"
    if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
      ip link del "$PREFIX-v$k" 2>/dev/null || true
      ip link add "$PREFIX-v$k" type veth peer name eth0 netns "$ns"
    fi
    ip link set "$PREFIX-v$k" master "$BRIDGE" up
    [[ $(ip -n "$ns" addr show dev eth0) == *"inet $(addr "$k")/24"* ]] || ip -n "$ns" addr add "$(addr "$k")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
  # names inside the namespaces (gloo and the torchrun rendezvous resolve the node's own hostname to its address)
  local hosts
  hosts=$(printf '127.0.0.1 localhost\n%s.1 %s-ctl\n' "$NET" "$PREFIX"; for k in $(seq 1 "$NODES"); do
    echo "$(addr "$k") $(node "$k")"; done)
  for k in $(seq 1 "$NODES"); do
    mkdir -p "/etc/netns/$(node "$k")"
    echo "$hosts" > "/etc/netns/$(node "$k")/hosts"
  done
  mkdir -p "$CONF_DIR"
  echo "$hosts" > "$CONF_DIR/hosts"  # slurmctld's
}

configure() {
  local k host nodes
  host=$PREFIX-ctl
  nodes="$(node 1)"; [ "$NODES" -gt 1 ] && nodes="$PREFIX-n[1-$NODES]"
  mkdir -p "$CONF_DIR" /var/spool/slurmctld-multi /var/spool/slurmd-multi /var/log/slurm /run/munge
  {
    cat <<CONF
ClusterName=asrl
SlurmctldHost=$host($NET.1)
SlurmctldPort=6917
SlurmdPort=6918
AuthType=auth/munge
CommunicationParameters=NoCtldInAddrAny
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=1
SlurmctldPidFile=/run/slurmctld-multi.pid
SlurmdPidFile=/run/slurmd-multi-%n.pid
SlurmdSpoolDir=/var/spool/slurmd-multi/%n
StateSaveLocation=/var/spool/slurmctld-multi
SlurmUser=root
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SlurmctldLogFile=/var/log/slurm/slurmctld-multi.log
SlurmdLogFile=/var/log/slurm/slurmd-multi-%n.log
CONF
    for k in $(seq 1 "$NODES"); do
      echo "NodeName=$(node "$k") NodeHostname=$(node "$k") NodeAddr=$(addr "$k") CPUs=$(nproc) RealMemory=4000 State=UNKNOWN"
    done
    echo "PartitionName=multi Nodes=$nodes Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
  } > "$CONF.new"
  mv "$CONF.new" "$CONF"
  rm -f "$CONF_DIR/cgroup.conf"
  munge_key /etc/munge/munge.key
  chown munge:munge /run/munge
}

# The key every daemon signs with: made (when missing) under umask 077, so it is never readable by others, not even
# between its write and the chmod.
munge_key() {
  if [ ! -s "$1" ]; then
    (umask 077; dd if=/dev/urandom bs=1 count=1024 of="$1" 2>/dev/null)
  fi
  chown munge:munge "$1"; chmod 400 "$1"
}

# a daemon of its pid file runs (a zombie, ended but not yet reaped by its parent, does not)
alive() { [ -f "$1" ] && [[ $(ps -o stat= -p "$(cat "$1")" 2>/dev/null) == [^Z]* ]]; }
any_alive() { local f; for f in "$@"; do alive "$f" && return 0; done; return 1; }

start() {
  install; network; configure
  pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
  # own UTS and mount namespaces: hostname asrl-ctl, which its hosts file resolves to the bridge address it binds
  alive /run/slurmctld-multi.pid ||
    unshare --uts --mount --propagation private sh -c \
      "mount --bind $CONF_DIR/hosts /etc/hosts && hostname $PREFIX-ctl && exec slurmctld -f $CONF"
  local k ns
  for k in $(seq 1 "$NODES"); do
    ns=$(node "$k")
    mkdir -p "/var/spool/slurmd-multi/$ns"
    # the node's network namespace, plus own UTS (`hostname` in a job step says the node's name) and mount
    # namespaces (its hosts file over /etc/hosts); not `ip netns exec`, whose fresh /sys has no cgroup mounts, which
    # slurmd needs. slurmd daemonizes inside them; every job step it starts inherits them.
    alive "/run/slurmd-multi-$ns.pid" ||
      nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private sh -c \
        "mount --bind /etc/netns/$ns/hosts /etc/hosts && hostname $ns && exec slurmd -f $CONF -N $ns"
  done
  for _ in $(seq 1 60); do
    if [ "$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -cE ' (idle|mixed|allocated)')" -ge "$NODES" ]; then
      sinfo -N; return 0
    fi
    sleep 1
  done
  echo "multi-node slurm did not become ready; see /var/log/slurm/*-multi*.log" >&2; sinfo -N >&2 || true; return 1
}

# Stop the cluster and remove what start made on the network: the cluster's jobs are cancelled, its daemons and
# anything left in its namespaces ended, then namespaces, veths, bridge and hosts files removed. Idempotent.
stop() {
  local f k ns pids
  alive /run/slurmctld-multi.pid && scancel --partition=multi 2>/dev/null || true
  for f in /run/slurmd-multi-*.pid /run/slurmctld-multi.pid; do
    alive "$f" && kill "$(cat "$f")" 2>/dev/null || true
  done
  for _ in $(seq 1 50); do
    any_alive /run/slurmd-multi-*.pid /run/slurmctld-multi.pid || break
    sleep 0.2
  done
  rm -f /run/slurmd-multi-*.pid /run/slurmctld-multi.pid
  for ns in $(ip netns list | awk -v p="^$PREFIX-n[0-9]+$" '$1 ~ p {print $1}'); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  for k in $(ip -o link show | awk -F': ' -v p="^$PREFIX-v[0-9]+(@|$)" '$2 ~ p {sub(/@.*/, "", $2); print $2}'); do
    ip link del "$k" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  if command -v iptables >/dev/null; then
    while iptables -D FORWARD -i "$BRIDGE" -o "$BRIDGE" -j ACCEPT 2>/dev/null; do :; done
  fi
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then  # sourced (tests): the functions only
  case "$cmd" in
    start) start ;;
    stop) stop ;;
    status) sinfo -N; squeue ;;
    *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
  esac
fi
