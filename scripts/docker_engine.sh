#!/usr/bin/env bash
# Make a Docker engine answer on this machine (idempotent): install Debian's docker.io and
# docker-compose (1.29) when missing, start dockerd when none answers, and wait for it. CI runs it
# before the tests (.ci/run) so tests/deploy/test_compose_live.py finds an engine; it needs root (or
# sudo). Exit status 0 only when `docker info` answers at the end.
#   bash scripts/docker_engine.sh
set -uo pipefail
log=${FOLIO_DOCKERD_LOG:-/var/log/folio-dockerd.log}
sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
say() { echo "docker_engine: $*" >&2; }

if docker info >/dev/null 2>&1; then say "an engine answers"; exit 0; fi

if ! command -v dockerd >/dev/null 2>&1 || ! command -v docker-compose >/dev/null 2>&1 \
   || ! command -v debootstrap >/dev/null 2>&1; then
  say "installing docker.io, docker-compose and debootstrap from apt"
  { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
      -o DPkg::Lock::Timeout=300 docker.io docker-compose debootstrap; } >/dev/null 2>&1 \
    || { say "apt-get could not install docker.io/docker-compose/debootstrap"; exit 1; }
fi

# an engine installed but not running (no systemd in containers and CI machines): start it detached,
# so it outlives this script; its socket is the default one, so a docker client found first on PATH
# (another version) talks to it too
if ! pgrep -x dockerd >/dev/null 2>&1; then
  say "starting dockerd (log: $log)"
  $sudo sh -c "nohup setsid dockerd >>'$log' 2>&1 </dev/null &"
fi
for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then say "the engine answers"; exit 0; fi
  sleep 1
done
say "dockerd did not answer within 60 s; its log ends:"
tail -n 20 "$log" >&2 2>/dev/null
exit 1
