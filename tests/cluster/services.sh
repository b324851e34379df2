#!/usr/bin/env bash
# A real single-node SLURM cluster (slurmctld, slurmd, slurmdbd with MariaDB, munge) and a
# PostgreSQL server, all on loopback, for the `cluster` tests. Needs root (the daemons run
# as their own users) and Debian's packages.
#
#   tests/cluster/services.sh install   # apt-get the packages (about 30 s)
#   tests/cluster/services.sh up        # start everything; prints `export ...` lines to eval
#   tests/cluster/services.sh down      # stop everything, by the PIDs it started
#
# State (data directories, logs, pid files) lives in $BATCHFIT_CLUSTER_DIR
# (default /tmp/batchfit-cluster). Stopping goes by pid file, after checking /proc/PID/comm:
# slurmctld and slurmdbd leave stale pid files behind.
set -euo pipefail

STATE=${BATCHFIT_CLUSTER_DIR:-/tmp/batchfit-cluster}
PG_PORT=${BATCHFIT_PG_PORT:-55432}
PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
CLUSTER=batchfit

log() { echo "services: $*" >&2; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local seconds=$1 what=$2
  shift 2
  for _ in $(seq $((seconds * 10))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  log "timed out waiting for $what"
  return 1
}

install() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends \
    slurm-wlm slurmdbd munge mariadb-server postgresql >/dev/null
}

start_munge() {
  mkdir -p /run/munge && chown munge:munge /run/munge
  [ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey --create
  runuser -u munge -- munged --pid-file=/run/munge/munged.pid </dev/null >/dev/null 2>&1
  wait_for 10 munge munge -n
}

start_mariadb() {
  mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
  # Unix socket only: nothing listens on a network port.
  mkdir -p "$STATE/mariadb" && chown mysql:mysql "$STATE/mariadb"
  mariadbd --user=mysql --skip-networking --socket=/run/mysqld/mysqld.sock \
    --pid-file="$STATE/mariadb/mariadb.pid" --log-error="$STATE/mariadb/mariadb.log" \
    </dev/null >>"$STATE/mariadb/mariadb.log" 2>&1 &
  wait_for 30 mariadb mariadb -uroot -e "select 1"
  mariadb -uroot -e "create database if not exists slurm_acct_db;
    create user if not exists 'slurm'@'localhost' identified by 'slurm';
    grant all on slurm_acct_db.* to 'slurm'@'localhost'; flush privileges;"
}

write_slurm_conf() {
  local node
  node=$(slurmd -C | head -1)
  mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm
  chown -R slurm:slurm /var/lib/slurm /var/log/slurm
  cat >/etc/slurm/slurm.conf <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
# Bind to the address this host resolves to (127.0.0.1 via SlurmctldHost/NodeAddr), not to
# every interface: the daemons listen on loopback only.
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
KillWait=5
MinJobAge=300
ReturnToService=2
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=$STATE/slurm/slurmctld.pid
SlurmdPidFile=$STATE/slurm/slurmd.pid
SlurmctldLogFile=$STATE/slurm/slurmctld.log
SlurmdLogFile=$STATE/slurm/slurmd.log
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  cat >/etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
CommunicationParameters=NoInAddrAny
SlurmUser=slurm
PidFile=$STATE/slurm/slurmdbd.pid
LogFile=$STATE/slurm/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=slurm
EOF
  chown slurm:slurm /etc/slurm/slurmdbd.conf
  chmod 600 /etc/slurm/slurmdbd.conf
}

start_slurm() {
  mkdir -p "$STATE/slurm" && chown slurm:slurm "$STATE/slurm"
  write_slurm_conf
  slurmdbd </dev/null >/dev/null 2>&1
  wait_for 30 slurmdbd sacctmgr -n list cluster
  sacctmgr -i add cluster "$CLUSTER" >/dev/null 2>&1 || true
  slurmctld </dev/null >/dev/null 2>&1
  slurmd </dev/null >/dev/null 2>&1
  wait_for 30 "an idle SLURM node" bash -c '[ "$(sinfo -h -o %T | head -1)" = idle ]'
}

start_postgres() {
  local data=$STATE/postgres
  rm -rf "$data"
  mkdir -p "$data" && chown postgres:postgres "$data"
  runuser -u postgres -- "$PG_BIN/initdb" -D "$data" -A trust -U postgres >/dev/null
  runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$data" -l "$data/server.log" -w \
    -o "-p $PG_PORT -k $data -c listen_addresses=127.0.0.1 -c max_connections=200" start >/dev/null
}

up() {
  mkdir -p "$STATE"
  chmod 755 "$STATE"
  start_munge
  start_mariadb
  start_slurm
  start_postgres
  log "SLURM (partition debug) and PostgreSQL (127.0.0.1:$PG_PORT) are up; state in $STATE"
  echo "export BATCHFIT_PG_URL=postgresql://postgres@127.0.0.1:$PG_PORT/postgres"
  echo "export BATCHFIT_SLURM=1"
}

stop_pid() {  # stop_pid PIDFILE EXPECTED_COMM [SIGNAL]
  local file=$1 comm=$2 signal=${3:-TERM} pid
  [ -f "$file" ] || return 0
  pid=$(head -1 "$file")
  if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ]; then
    kill "-$signal" "$pid"
    for _ in $(seq 100); do [ -e "/proc/$pid" ] || break; sleep 0.1; done
  fi
  rm -f "$file"
}

down() {
  scancel --user=root >/dev/null 2>&1 || true
  stop_pid "$STATE/slurm/slurmd.pid" slurmd
  stop_pid "$STATE/slurm/slurmctld.pid" slurmctld
  stop_pid "$STATE/slurm/slurmdbd.pid" slurmdbd
  stop_pid "$STATE/postgres/postmaster.pid" postgres INT
  stop_pid "$STATE/mariadb/mariadb.pid" mariadbd
  stop_pid /run/munge/munged.pid munged
  log "stopped"
}

case "${1:-}" in
  install) install ;;
  up) up ;;
  down) down ;;
  *) echo "usage: $0 install|up|down" >&2; exit 2 ;;
esac
