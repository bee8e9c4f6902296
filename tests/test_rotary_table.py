"""The rotary embedding's reserved cos/sin table (`RotaryEmbedding.reserve`): a step's rows
gathered from it equal the rows computed for the step, bit for bit (Llama-3.1-8B's llama3
scaling, bf16 and float32); a table of another dtype or device is not used."""
import json

import pytest
import torch

from sparseengine.layers.rotary import RotaryEmbedding
from sparseengine.models.loader import SHAPES_DIR
from sparseengine.models.model_config import ModelConfig

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _rotary(device):
    config = ModelConfig.from_hf(json.loads((SHAPES_DIR / "llama-3.1-8b.json").read_text()), "llama-3.1-8b")
    rotary = RotaryEmbedding(config).to(device)
    rotary.inv_freq = rotary.inv_freq.float()  # as the engine keeps it
    return rotary


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reserved_rows_equal_computed(device, dtype):
    rotary = _rotary(device)
    n = 133120  # the headline's max_model_len, past the shape's 131072 positions
    gen = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.tensor([0, n - 1]), torch.randint(0, n, (37,), generator=gen)]).to(device)
    want = rotary.cos_sin(positions, dtype)  # no table yet: computed
    rotary.reserve(n, dtype)
    assert rotary.table.shape == (n, 2 * 128) and rotary.table.dtype == dtype
    got = rotary.cos_sin(positions, dtype)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == dtype and g.stride(-1) == 1
        assert torch.equal(g, w)


def test_table_of_another_dtype_is_not_used():
    rotary = _rotary("cpu")
    rotary.reserve(64, torch.bfloat16)
    rotary.table.zero_()  # a table the next call must not read
    cos, sin = rotary.cos_sin(torch.tensor([3, 5]), torch.float32)
    assert cos.dtype == torch.float32 and bool((cos != 0).any()) and bool((sin != 0).any())
