#!/bin/bash
# Copy of ../shared/slurm/local-cluster.sh (the shared workspace script), for CI on a clean clone.
# Start a real single-node Slurm cluster (munge + slurmctld + slurmd) on this machine.
# Debian bookworm packages, Slurm 22.05. Idempotent: safe to run twice.
# Usage: sudo-less root shell: bash local-cluster.sh [start|stop|status]
# After `start`, sbatch/squeue/scontrol/scancel work against partition "debug".
set -euo pipefail
cmd="${1:-start}"
conf=/etc/slurm/slurm.conf

install() {
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null
  fi
}

configure() {
  local host cpus mem
  host=$(hostname -s); cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 - 2048 ))
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
  cat > "$conf" <<CONF
ClusterName=local
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/spool/slurmd
StateSaveLocation=/var/spool/slurmctld
SlurmUser=root
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
  # Slurm 22.05 has no "disabled" cgroup plugin: leave cgroup.conf absent.
  rm -f /etc/slurm/cgroup.conf
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  fi
  chown munge:munge /etc/munge/munge.key /run/munge; chmod 400 /etc/munge/munge.key
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  install; configure
  pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
  # by pid file, not by name: multi-node-cluster.sh runs another slurmctld and slurmd beside these
  alive /run/slurmctld.pid || slurmctld
  alive /run/slurmd.pid || slurmd
  for _ in $(seq 1 30); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then sinfo; return 0; fi
    sleep 1
  done
  echo "slurm did not become ready; see /var/log/slurm/" >&2; return 1
}

stop() {
  for p in slurmd slurmctld; do
    [ -f /run/$p.pid ] && kill "$(cat /run/$p.pid)" 2>/dev/null || true
  done
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  status) sinfo; squeue ;;
  *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac
