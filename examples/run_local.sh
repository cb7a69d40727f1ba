#!/usr/bin/env bash
# Runs examples/tf_config_job.py as a whole job on this machine: one process
# per task, each with its own TF_CONFIG (rpc_layer "grpc+rdma_device"), on
# free loopback ports, RDMA_DEVICE_STRICT=1 (a tensor that would fall back
# to gRPC fails the job). What a cluster scheduler does, minus the hosts.
#
#   bash examples/run_local.sh mwms [WORKERS]     (default 2 workers)
#   bash examples/run_local.sh pss                (chief, 2 workers, 1 ps)
#
# PYTHON picks the interpreter (default python3). Every process runs under
# a deadline (RUN_LOCAL_TIMEOUT, 300 s); ps/worker servers of pss are
# stopped once the chief is done. Exit status: the training tasks'.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}
MODE=${1:?usage: run_local.sh mwms|pss [WORKERS]}
DEADLINE=${RUN_LOCAL_TIMEOUT:-300}
export RDMA_DEVICE_STRICT=1 TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
LOGS=$(mktemp -d)

free_ports() {
  "$PYTHON" -c "import socket,sys
s=[socket.socket() for _ in range(int(sys.argv[1]))]
[x.bind(('127.0.0.1',0)) for x in s]
print(' '.join(str(x.getsockname()[1]) for x in s))" "$1"
}

case "$MODE" in
  mwms) N=${2:-2}; read -r -a P <<< "$(free_ports "$N")"
        CLUSTER=$(printf '"127.0.0.1:%s",' "${P[@]}"); CLUSTER="{\"worker\": [${CLUSTER%,}]}"
        TASKS=(); for i in $(seq 0 $((N - 1))); do TASKS+=("worker $i train"); done ;;
  pss)  read -r -a P <<< "$(free_ports 4)"
        CLUSTER="{\"chief\": [\"127.0.0.1:${P[0]}\"], \"worker\": [\"127.0.0.1:${P[1]}\", \"127.0.0.1:${P[2]}\"], \"ps\": [\"127.0.0.1:${P[3]}\"]}"
        TASKS=("ps 0 serve" "worker 0 serve" "worker 1 serve" "chief 0 train") ;;
  *) echo "usage: run_local.sh mwms|pss [WORKERS]" >&2; exit 2 ;;
esac

PIDS=(); TRAIN=(); SERVE=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$LOGS"; }
trap cleanup EXIT
for t in "${TASKS[@]}"; do
  read -r type index role <<< "$t"
  TF_CONFIG="{\"cluster\": $CLUSTER, \"task\": {\"type\": \"$type\", \"index\": $index}, \"rpc_layer\": \"grpc+rdma_device\"}" \
    timeout "$DEADLINE" "$PYTHON" "$HERE/tf_config_job.py" "$MODE" > "$LOGS/$type-$index.out" 2> "$LOGS/$type-$index.err" &
  PIDS+=($!)
  if [ "$role" = train ]; then TRAIN+=("$!:$type-$index"); else SERVE+=("$!"); fi
done
rc=0
for t in "${TRAIN[@]}"; do
  pid=${t%%:*}; name=${t#*:}
  if wait "$pid"; then
    echo "$name: $(grep '^RESULT' "$LOGS/$name.out" | head -1)"
  else
    st=$?; rc=1; echo "$name failed (exit $st); its stderr:" >&2; tail -20 "$LOGS/$name.err" >&2
  fi
done
exit $rc
