#!/usr/bin/env bash
# Scale out on one machine: N mlxcel-server replicas behind vllm-router, all on loopback.
#
#   scripts/cluster.sh --replicas N --port P [cluster options] [server flags...]
#
# Starts N replicas on free loopback ports (every server flag after the cluster options goes to
# each replica unchanged, e.g. -m /models/Qwen3-1.7B -c 8192 -np 4 --metrics), waits until each
# answers /health, then starts vllm-router on 127.0.0.1:P with the consistent_hash policy, so
# requests carrying the same X-Session-ID header stay on the replica that holds their cached
# prefix. Runs in the foreground; SIGTERM or Ctrl-C stops every process it started, each by its
# own PID (router first, then the replicas). If any of them exits, the others are stopped too.
#
# Cluster options (the command line above is a stable contract):
#   --replicas N        number of mlxcel-server replicas (required, >= 1)
#   --port P            the router's port on 127.0.0.1 (required; 0 = a free one)
#   --policy NAME       vllm-router policy (default consistent_hash; round_robin, power_of_two, ...)
#   --log-dir DIR       where the logs go (default logs/cluster-YYYYmmdd-HHMMSS-PID under the
#                       checkout): replica-I.log, router.log, and cluster.env naming the router URL,
#                       each replica's URL and each process's PID
#   --router-arg ARG    one more vllm-router argument (repeatable), e.g. --router-arg=--log-level=debug
#   --startup-timeout S seconds to wait for each replica's /health (default 600)
#   --                  end of cluster options (everything after it goes to the replicas)
#
# vllm-router comes from PyPI (pip install vllm-router; it is in this project's test extra, so
# the .venv that scripts/setup.sh builds has it). docs/scaling-out.md explains the set-up.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() { sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
die() { echo "cluster.sh: $*" >&2; exit 2; }

replicas="" port="" policy="consistent_hash" log_dir="" startup_timeout=600
router_args=()
server_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --replicas) [ $# -ge 2 ] || die "--replicas needs a value"; replicas="$2"; shift 2 ;;
    --replicas=*) replicas="${1#*=}"; shift ;;
    --port) [ $# -ge 2 ] || die "--port needs a value"; port="$2"; shift 2 ;;
    --port=*) port="${1#*=}"; shift ;;
    --policy) [ $# -ge 2 ] || die "--policy needs a value"; policy="$2"; shift 2 ;;
    --policy=*) policy="${1#*=}"; shift ;;
    --log-dir) [ $# -ge 2 ] || die "--log-dir needs a value"; log_dir="$2"; shift 2 ;;
    --log-dir=*) log_dir="${1#*=}"; shift ;;
    --router-arg) [ $# -ge 2 ] || die "--router-arg needs a value"; router_args+=("$2"); shift 2 ;;
    --router-arg=*) router_args+=("${1#*=}"); shift ;;
    --startup-timeout) [ $# -ge 2 ] || die "--startup-timeout needs a value"; startup_timeout="$2"; shift 2 ;;
    --startup-timeout=*) startup_timeout="${1#*=}"; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; server_args+=("$@"); break ;;
    *) server_args+=("$1"); shift ;;
  esac
done
[[ "$replicas" =~ ^[1-9][0-9]*$ ]] || die "--replicas N is required (N >= 1)"
[[ "$port" =~ ^[0-9]+$ ]] && [ "$port" -le 65535 ] || die "--port P is required (0-65535)"
[[ "$startup_timeout" =~ ^[0-9]+$ ]] || die "--startup-timeout takes whole seconds"
for a in "${server_args[@]+"${server_args[@]}"}"; do
  case "$a" in
    --host|--host=*|--port=*) die "$a: the cluster chooses each replica's host and port" ;;
  esac
done

source "$root/scripts/setup.sh"  # the project's .venv (with vllm-router from the test extra)
router_bin="$venv/bin/vllm-router"
[ -x "$router_bin" ] || router_bin="$(command -v vllm-router || true)"
[ -n "$router_bin" ] || die "vllm-router is not installed: $venv/bin/pip install vllm-router"

log_dir="${log_dir:-$root/logs/cluster-$(date +%Y%m%d-%H%M%S)-$$}"
mkdir -p "$log_dir"
log_dir="$(cd "$log_dir" && pwd)"

# Free loopback ports from the OS, all distinct: N replicas, the router's Prometheus listener
# (vllm-router's default 29000 would clash between clusters), and the router itself if P is 0.
n_ports=$((replicas + 1 + (port == 0 ? 1 : 0)))
read -r -a ports <<<"$("$venv/bin/python" - "$n_ports" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
)"
replica_ports=("${ports[@]:0:replicas}")
prometheus_port="${ports[replicas]}"
[ "$port" -ne 0 ] || port="${ports[replicas + 1]}"

pids=()  # every process this script started, in start order
names=()
stopping=0

stop_all() {
  # Router first (it stops sending work), then the replicas; each by its own PID.
  [ "$stopping" = 1 ] && return
  stopping=1
  local i pid
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    pid="${pids[i]}"
    if kill -0 "$pid" 2>/dev/null; then
      echo "cluster.sh: stopping ${names[i]} (pid $pid)" >&2
      kill -TERM "$pid" 2>/dev/null || true
    fi
  done
  local deadline=$((SECONDS + 20))
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    pid="${pids[i]}"
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "cluster.sh: ${names[i]} (pid $pid) ignored SIGTERM; killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
  echo "cluster.sh: stopped; logs in $log_dir" >&2
}
trap 'stop_all; exit 143' TERM
trap 'stop_all; exit 130' INT
trap 'stop_all' EXIT

env_file="$log_dir/cluster.env"
: >"$env_file"
urls=()
for ((i = 0; i < replicas; i++)); do
  p="${replica_ports[i]}"
  "$venv/bin/python" -m mlxcel_compat "${server_args[@]+"${server_args[@]}"}" --host 127.0.0.1 --port "$p" \
    >"$log_dir/replica-$i.log" 2>&1 </dev/null &
  pids+=("$!")
  names+=("replica $i")
  urls+=("http://127.0.0.1:$p")
  echo "REPLICA_${i}_URL=http://127.0.0.1:$p" >>"$env_file"
  echo "REPLICA_${i}_PID=$!" >>"$env_file"
  echo "cluster.sh: replica $i on http://127.0.0.1:$p (pid $!, log $log_dir/replica-$i.log)" >&2
done

# The router sends a session to its replica at once: start it only when every replica is ready
# (a replica still loading answers 503, which the router would count against it).
for ((i = 0; i < replicas; i++)); do
  deadline=$((SECONDS + startup_timeout))
  until "$venv/bin/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health", timeout=2)' \
      "${urls[i]}" 2>/dev/null; do
    if ! kill -0 "${pids[i]}" 2>/dev/null; then
      echo "cluster.sh: replica $i exited during start-up; its log:" >&2
      tail -n 20 "$log_dir/replica-$i.log" >&2
      exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "cluster.sh: replica $i not healthy after ${startup_timeout}s (log $log_dir/replica-$i.log)" >&2
      exit 1
    fi
    sleep 0.25
  done
done

"$router_bin" --host 127.0.0.1 --port "$port" --policy "$policy" --worker-urls "${urls[@]}" \
  --prometheus-host 127.0.0.1 --prometheus-port "$prometheus_port" \
  "${router_args[@]+"${router_args[@]}"}" >"$log_dir/router.log" 2>&1 </dev/null &
pids+=("$!")
names+=("vllm-router")
{
  echo "ROUTER_URL=http://127.0.0.1:$port"
  echo "ROUTER_PID=$!"
  echo "ROUTER_METRICS_URL=http://127.0.0.1:$prometheus_port/metrics"
  echo "POLICY=$policy"
  echo "REPLICAS=$replicas"
} >>"$env_file"

deadline=$((SECONDS + 60))
until "$venv/bin/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health", timeout=2)' \
    "http://127.0.0.1:$port" 2>/dev/null; do
  if ! kill -0 "${pids[-1]}" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
    echo "cluster.sh: vllm-router did not come up; its log:" >&2
    tail -n 20 "$log_dir/router.log" >&2
    exit 1
  fi
  sleep 0.25
done
echo "READY=1" >>"$env_file"
echo "cluster.sh: vllm-router ($policy) on http://127.0.0.1:$port in front of ${replicas} replica(s); logs in $log_dir" >&2
echo "cluster.sh: Ctrl-C or SIGTERM stops everything" >&2

# Stay in the foreground until a signal arrives or one of the processes exits.
set +e
wait -n "${pids[@]}"
status=$?
if [ "$stopping" = 0 ]; then
  for ((i = 0; i < ${#pids[@]}; i++)); do
    kill -0 "${pids[i]}" 2>/dev/null || echo "cluster.sh: ${names[i]} (pid ${pids[i]}) exited; stopping the rest" >&2
  done
fi
exit $((status == 0 ? 1 : status))
