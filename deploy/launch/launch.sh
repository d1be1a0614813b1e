#!/usr/bin/env bash
# Multi-node FreeScale training: run this script once on EVERY node (the Ray head node first is fine).
# torchrun rendezvouses on the head node (c10d, HEAD_ADDR:RDZV_PORT); every trainer rank then attaches its
# loader to the running Ray cluster (--loader ray --ray-address HEAD_ADDR:6379), where one named coordinator
# plans the balanced microbatches and reader actors on all nodes read the data.
#
# Required env:   HEAD_ADDR        address of the Ray head node (also the rendezvous host)
#                 DATA             dataset directory on a filesystem every node sees
#                 RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH   the cluster's Ray token (token auth stays on)
# Optional env:   NNODES (2) NPROC_PER_NODE (8) RDZV_PORT (29400) RAY_PORT (6379) BACKEND (nccl)
#                 WORK_DIR (/shared/tmp, shared) RUN_ID (freescale) METRICS_OUT (metrics.jsonl)
#                 PYTHON (python) DRY_RUN=1 prints the command instead of running it
# Extra arguments go to `freescale train` (e.g. --steps 1000 --microbatches 4).
set -euo pipefail

: "${HEAD_ADDR:?set HEAD_ADDR to the Ray head node address}"
: "${DATA:?set DATA to the dataset directory (shared filesystem)}"
NNODES="${NNODES:-2}"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
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

cmd=("$PYTHON" -m torch.distributed.run
     --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
     --rdzv-backend c10d --rdzv-endpoint "${HEAD_ADDR}:${RDZV_PORT}" --rdzv-id "$RUN_ID"
     -m freescale train --data "$DATA" --work-dir "$WORK_DIR" --backend "$BACKEND"
     --loader ray --ray-address "${HEAD_ADDR}:${RAY_PORT}" --metrics-out "$METRICS_OUT" "$@")

if [[ "${DRY_RUN:-0}" == "1" ]]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
