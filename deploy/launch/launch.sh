#!/usr/bin/env bash
# Multi-node FreeScale training: run this script once on EVERY trainer node (NNODES of them). torchrun
# rendezvouses through a c10d store that ONE of those nodes hosts (RDZV_ADDR:RDZV_PORT); every trainer rank
# then attaches its loader to the running Ray cluster (--loader ray --ray-address HEAD_ADDR:6379), where one
# named coordinator plans the balanced microbatches and reader actors on all nodes read the data.
#
# Required env:   HEAD_ADDR        address of the Ray head node
#                 DATA             dataset directory on a filesystem every node sees
#                 RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH   the cluster's Ray token (token auth stays on)
# Optional env:   RDZV_ADDR (HEAD_ADDR)  address of the trainer node that hosts the rendezvous store: it must
#                                  run this script too (on Kubernetes: the first GPU worker pod's IP, not the
#                                  head Service, which runs no trainer)
#                 RDZV_IS_HOST     1 on that node, 0 on the others (unset: torch decides by matching
#                                  RDZV_ADDR against this machine's hostname and addresses)
#                 LOCAL_ADDR       this node's address as the other nodes reach it (unset: its FQDN)
#                 NNODES (2) NPROC_PER_NODE (8) RDZV_PORT (29400) RAY_PORT (6379) BACKEND (nccl)
#                 WORK_DIR (/shared/tmp, shared) RUN_ID (freescale) METRICS_OUT (metrics.jsonl)
#                 PYTHON (python) DRY_RUN=1 prints the command instead of running it
# Extra arguments go to `freescale train` (e.g. --steps 1000 --microbatches 4).
set -euo pipefail

: "${HEAD_ADDR:?set HEAD_ADDR to the Ray head node address}"
: "${DATA:?set DATA to the dataset directory (shared filesystem)}"
NNODES="${NNODES:-2}"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
RDZV_ADDR="${RDZV_ADDR:-$HEAD_ADDR}"
RDZV_PORT="${RDZV_PORT:-29400}"
RAY_PORT="${RAY_PORT:-6379}"
BACKEND="${BACKEND:-nccl}"
WORK_DIR="${WORK_DIR:-/shared/tmp}"
RUN_ID="${RUN_ID:-freescale}"
METRICS_OUT="${METRICS_OUT:-metrics.jsonl}"
PYTHON="${PYTHON:-python}"

# Token auth stays on: never start or join a cluster without a token.
export RAY_AUTH_MODE=token
if [[ -z "${RAY_AUTH_TOKEN:-}" && -z "${RAY_AUTH_TOKEN_PATH:-}" && ! -s "${HOME}/.ray/auth_token" ]]; then
  echo "launch.sh: no Ray auth token (set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, or put it in ~/.ray/auth_token)" >&2
  exit 2
fi
# Multi-node Ray needs this unset or 1 (the Makefile's local default of 0 forbids joining other nodes).
if [[ "${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-1}" == "0" ]]; then
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1
fi

rdzv=(--rdzv-backend c10d --rdzv-endpoint "${RDZV_ADDR}:${RDZV_PORT}" --rdzv-id "$RUN_ID")
case "${RDZV_IS_HOST:-}" in
  "") ;;
  1) rdzv+=(--rdzv-conf is_host=true) ;;
  0) rdzv+=(--rdzv-conf is_host=false) ;;
  *) echo "launch.sh: RDZV_IS_HOST must be 1, 0 or unset, got '${RDZV_IS_HOST}'" >&2; exit 2 ;;
esac
if [[ -n "${LOCAL_ADDR:-}" ]]; then
  rdzv+=(--local-addr "$LOCAL_ADDR")
fi

cmd=("$PYTHON" -m torch.distributed.run
     --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" "${rdzv[@]}"
     -m freescale train --data "$DATA" --work-dir "$WORK_DIR" --backend "$BACKEND"
     --loader ray --ray-address "${HEAD_ADDR}:${RAY_PORT}" --metrics-out "$METRICS_OUT" "$@")

if [[ "${DRY_RUN:-0}" == "1" ]]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
