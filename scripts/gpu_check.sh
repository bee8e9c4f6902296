#!/usr/bin/env bash
# One device call that checks and times: the kernel tests compiled on the GPU, an engine
# sanity run (pool sized by the warm-up, graphs vs eager), then the decode benchmark.
#   bash scripts/gpu_check.sh [bench_decode_128k.py arguments]
set -euo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python -m pytest tests/kernels -q -x -p no:cacheprovider
python - <<'PY'
import torch
from sparseengine import LLM, SamplingParams
with LLM("llama-3.1-8b", load_format="dummy", dtype="bfloat16", max_model_len=8192) as llm:
    free, total = torch.cuda.mem_get_info()
    print(f"pool pages {llm.allocator.num_pages} ({llm.kv_cache.nbytes / 2**30:.1f} GiB), "
          f"free after {free / 2**30:.1f} of {total / 2**30:.1f} GiB")
    out = llm.generate([[5] * 3000] * 4, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    print("graph steps", llm.runner.graph_steps, "tokens", len(out[0].token_ids))
PY
if [ "$#" -gt 0 ]; then python scripts/bench_decode_128k.py "$@"; fi
