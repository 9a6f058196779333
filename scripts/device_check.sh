#!/usr/bin/env bash
# The device check: pdserve's GPU path on one NVIDIA GPU, in one go, one JSON report.
#
#   python scripts/gpu_bundle/build.py        # once, where PyPI is reachable -> .gpu-bundle/
#   scripts/device_check.sh [OUT_DIR]         # on the GPU machine (no package index needed)
#
# Needs there: python3 with a CUDA torch, nvcc, transformers, numpy (the rest comes from
# .gpu-bundle/site.tar.xz). Writes OUT_DIR/device_check.json (OUT_DIR: $OUT, else
# ./device-check-out) and OUT_DIR/device_check.log; exits 0 when every part met its target.
# Parts and targets: libs/pdserve_bench/gpu/__init__.py.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-device-check-out}}
BUNDLE=${PDSERVE_GPU_BUNDLE:-.gpu-bundle}
SITE=${PDSERVE_GPU_SITE:-/tmp/pdserve-gpu-site}
PY=${PYTHON:-python3}

if [[ ! -f $BUNDLE/site.tar.xz ]]; then
  echo "device_check: $BUNDLE/site.tar.xz is missing: run python scripts/gpu_bundle/build.py" \
       "where PyPI is reachable, and bring $BUNDLE along" >&2
  exit 2
fi
mkdir -p "$OUT_DIR" "$SITE"
tar -xJf "$BUNDLE/site.tar.xz" -C "$SITE"
if [[ ! -f libs/pdserve/proto/v1/__init__.py ]]; then
  mkdir -p libs/pdserve/proto/v1
  cp "$BUNDLE"/proto/*.py libs/pdserve/proto/v1/
fi
NVCC=$(command -v nvcc || true)
export CUDA_HOME=${CUDA_HOME:-${NVCC:+$(dirname "$(dirname "$NVCC")")}}
export PYTHONPATH="$SITE:$PWD/libs:$PWD" PYTHONUNBUFFERED=1 UCXPY_PROGRESS_MODE=blocking
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/pdserve-flashinfer}
# FlashInfer's norms: its CUDA kernels (compiled here), not the CuTe DSL (not in the bundle).
export FLASHINFER_USE_CUDA_NORM=1
# They include cuBLAS's and cuRAND's headers: the bundle's when the toolkit here lacks them.
if [[ ! -f ${CUDA_HOME:-/usr/local/cuda}/include/cublasLt.h ||
      ! -f ${CUDA_HOME:-/usr/local/cuda}/include/curand_kernel.h ]]; then
  INCLUDE=$(cd "$BUNDLE/cuda-include" && pwd)
  export FLASHINFER_EXTRA_CUDAFLAGS="-isystem $INCLUDE ${FLASHINFER_EXTRA_CUDAFLAGS:-}"
  export FLASHINFER_EXTRA_CFLAGS="-isystem $INCLUDE ${FLASHINFER_EXTRA_CFLAGS:-}"
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
"$PY" -m pdserve_bench.gpu --out "$OUT_DIR/device_check.json" 2>&1 | tee "$OUT_DIR/device_check.log"
