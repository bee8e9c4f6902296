import os
import subprocess
import sys

import torch

SCRIPT = """
import sys, torch
import sparseengine.kernels as K
from sparseengine.kernels.testing import random_paged_kv
assert "triton" not in sys.modules, "importing the kernels must not import Triton"
kv = random_paged_kv([5], 1, 16, 4, generator=torch.Generator().manual_seed(0))
try:
    K.paged_decode_triton(torch.randn(1, 1, 16), kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
except RuntimeError as e:
    assert "TRITON_INTERPRET" in str(e), e
else:
    raise AssertionError("a CPU launch without the interpreter must fail clearly")
"""


def test_import_needs_no_triton_and_cpu_launch_fails_clearly():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = SCRIPT if not torch.cuda.is_available() else SCRIPT.split("kv = ")[0]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", script], check=True, cwd=root, env=env, timeout=120)
