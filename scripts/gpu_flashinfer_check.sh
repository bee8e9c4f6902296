#!/usr/bin/env bash
# One device call for the FlashInfer provider: install the carried wheels, build FlashInfer's
# two JIT modules (bf16, head_dim 128: CUDA-core decode, FA2 paged prefill) in parallel,
# run the Triton vs FlashInfer decode side by side, then the GPU tests of the provider.
#   bash scripts/gpu_flashinfer_check.sh [all|build] (carry .whl/flashinfer; results under $OUT, else /tmp/fi_out)
# `build` only installs and builds the modules (scripts/gpu_session.sh runs it beside other work).
# Wheels: .whl/flashinfer/ (flashinfer-python 0.7.2.post1 + apache-tvm-ffi), see the provider.
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fi_out}
mkdir -p "$OUT"
if ! python3 -c "import flashinfer" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${FI_WHEELS:-.whl/flashinfer}"/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
if [ -z "${CUDA_HOME:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDA_HOME=/usr/local/cuda
fi
echo "nvcc: $(command -v nvcc || echo "${CUDA_HOME:-none}/bin/nvcc")"; nvcc --version 2>/dev/null | tail -1 || true
python3 -c "import torch, triton, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__,
'flashinfer', flashinfer.__version__, torch.cuda.get_device_name())"

# The first plan of each kind builds its module; the two builds run side by side.
warm() {
python3 - "$1" <<'PY'
import sys, time
import torch
from sparseengine.attention.flashinfer_provider import FlashInferAttentionProvider
from sparseengine.engine.step_context import LayerView, StepContext
kind = sys.argv[1]
t0 = time.perf_counter()
fi = FlashInferAttentionProvider(torch.device("cuda"), decode_tensor_cores=False)
kc = torch.randn(8, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
table = torch.arange(8, dtype=torch.int32, device="cuda").view(2, 4)
n = 1 if kind == "decode" else 20
view = LayerView(torch.zeros(2 * n, dtype=torch.long, device="cuda"), torch.tensor([50, 60], dtype=torch.int32,
                 device="cuda"), (50, 60), table)
ctx = StepContext(seqs=[None, None], q_lens=(n, n), cu_q_lens=torch.tensor([0, n, 2 * n], dtype=torch.int32,
                  device="cuda"), is_decode=n == 1, views=[view], kv_cache=None, provider=fi, method=None,
                  positions=None)
q = torch.randn(2 * n, 32, 128, device="cuda", dtype=torch.bfloat16)
fi.attend(q, kc, kc, ctx, view, None, None)
torch.cuda.synchronize()
print(f"flashinfer {kind} module ready in {time.perf_counter() - t0:.0f} s", flush=True)
PY
}
warm decode > "$OUT/jit_decode.log" 2>&1 & d=$!
warm prefill > "$OUT/jit_prefill.log" 2>&1 & p=$!
status=0; wait $d || status=1; wait $p || status=1
cat "$OUT/jit_decode.log" "$OUT/jit_prefill.log" | tail -40
[ $status -eq 0 ] || { echo "FlashInfer JIT build failed"; exit 1; }
[ "${1:-all}" = build ] && exit 0

python3 -m sparseengine.kernels.bench_gpu --flashinfer --out "$OUT/bench_flashinfer.jsonl" || echo "bench_gpu --flashinfer FAILED (see above)"
python3 -m pytest tests/attention -q -p no:cacheprovider -rs --durations=15 2>&1 | tee "$OUT/pytest_attention.log"
