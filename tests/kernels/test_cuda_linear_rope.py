"""The qkv projection with the rotary embedding and the KV write in its epilogue
(`cuda_linear_rope`): on the H200 the same bits as the two launches it replaces (the
projection, then `rotary_kv_write_triton`), near the torch oracle, and in the engine the
same tokens as without it; on the CPU its argument checks and its switch."""
from __future__ import annotations

import json

import pytest
import torch

from sparseengine.kernels import cuda_linear, cuda_linear_rope as R
from sparseengine.kernels.fused_ops import rotary_kv_write_triton

BF16 = torch.bfloat16
D = 128


def _args(device="cpu", rows=6, hq=4, hkv=2, k=2048, pages=12, page_size=16, gen=None, stride_pad=0):
    gen = gen or torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    w = (torch.randn((hq + 2 * hkv) * D, k, generator=gen) / k ** 0.5).to(BF16)
    pos = torch.randint(0, 4000, (rows,), generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = pos[:, None].float() * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(BF16), torch.cat([ang.sin()] * 2, -1).to(BF16)
    # the caches as a layer's view of one buffer of token rows (a page stride past its own rows)
    buf = torch.zeros(pages, page_size, hkv * D + stride_pad, dtype=BF16)
    k_cache = buf[:, :, : hkv * D].unflatten(-1, (hkv, D))
    v_cache = torch.zeros(pages, page_size, hkv, D, dtype=BF16)
    slots = torch.randperm(pages * page_size, generator=gen)[:rows].long()
    if rows > 1:
        slots[rows // 2] = -1  # a padding row: written nowhere
    t = dict(x=x, weight=w, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    t = {n: v.to(device) for n, v in t.items()}
    return dict(t, rms_eps=1e-5, num_heads=hq, num_kv_heads=hkv)


def test_bad_input():
    a = _args()
    with pytest.raises(ValueError, match=r"\(Hq \+ 2 Hkv\) \* 128 rows for Hq=5, Hkv=2, got 1024"):
        R.qkv_rope(**dict(a, num_heads=5))
    with pytest.raises(ValueError, match=r"cos must be \[6, 128\]"):
        R.qkv_rope(**dict(a, cos=a["cos"][:, :64]))
    with pytest.raises(ValueError, match="sin must be .* torch.bfloat16"):
        R.qkv_rope(**dict(a, sin=a["sin"].float()))
    wide = torch.zeros(6, 260, dtype=BF16)
    with pytest.raises(ValueError, match="16-byte aligned with a row stride a multiple of 8, got stride 260"):
        R.qkv_rope(**dict(a, cos=wide[:, :128], sin=wide[:, 130:258]))
    with pytest.raises(ValueError, match="at byte offsets 0 and 4"):
        R.qkv_rope(**dict(a, cos=wide[:, :128].contiguous(), sin=torch.zeros(6 * 128 + 2, dtype=BF16)[2:].view(6, 128)))
    with pytest.raises(ValueError, match=r"v_cache must be \[pages, page_size, 2, 128\]"):
        R.qkv_rope(**dict(a, v_cache=a["v_cache"][:, :, :1]))
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        R.qkv_rope(**dict(a, slot_mapping=a["slot_mapping"].int()))
    with pytest.raises(ValueError, match="takes 1 to 8 rows, got 9"):
        R.qkv_rope(**dict(a, x=torch.zeros(9, 2048, dtype=BF16)))
    with pytest.raises(RuntimeError, match="cannot run: needs a CUDA device, got cpu"):
        R.qkv_rope(**a)


def test_switch(monkeypatch):
    """On by default (measured on the H200 in session 45); it takes what `cuda_linear` takes
    with heads of 128, never a CPU tensor."""
    a = _args()
    assert R.ENGINE is True
    assert not R.takes(a["x"], a["weight"], D)  # the CPU
    assert not R.takes(a["x"], a["weight"], 64)


# ---------------------------------------------------------------------------- on the GPU


def _unfused(a):
    """The two launches the epilogue replaces, on copies of the caches."""
    kc, vc = a["k_cache"].clone(), a["v_cache"].clone()
    y = cuda_linear.cuda_linear(a["x"], a["weight"], rms_eps=a["rms_eps"])
    hq, hkv, rows = a["num_heads"], a["num_kv_heads"], a["x"].shape[0]
    q, k, v = y.split([hq * D, hkv * D, hkv * D], dim=-1)
    q = rotary_kv_write_triton(q.reshape(rows, hq, D), k.reshape(rows, hkv, D), v.reshape(rows, hkv, D),
                               a["cos"], a["sin"], kc, vc, a["slot_mapping"])
    return q, kc, vc


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hq,hkv,k,staged", [(1, 4, 2, 2048, None), (6, 32, 8, 4096, None),
                                                  (8, 16, 4, 2048, True), (6, 32, 8, 4096, False)])
def test_gpu_same_bits_as_the_two_launches(rows, hq, hkv, k, staged):
    reason = cuda_linear.unavailable("cuda")
    assert reason is None, reason
    a = _args("cuda", rows, hq, hkv, k, stride_pad=256, gen=torch.Generator().manual_seed(rows + hq))
    want_q, want_k, want_v = _unfused(a)
    kc, vc = a["k_cache"], a["v_cache"]
    got_q = R.qkv_rope(**a, staged=staged)
    assert torch.equal(got_q, want_q)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert kc.abs().sum() > 0 and vc.abs().sum() > 0  # written at the real rows' slots
    ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
    ref_q = R.qkv_rope_ref(**dict(a, k_cache=ref_k, v_cache=ref_v))
    assert (got_q.float() - ref_q.float()).abs().max() <= 0.02 * ref_q.float().abs().max()
    assert (kc.float() - ref_k.float()).abs().max() <= 0.02 * ref_k.float().abs().max()


@pytest.mark.gpu
def test_gpu_in_the_engine(tmp_path, monkeypatch):
    """A model whose qkv the kernel takes: with the epilogue on, its eager and graph tokens
    are those without it (the same bits go to q and the caches)."""
    from sparseengine import LLM, SamplingParams
    from sparseengine.models.loader import SHAPES_DIR

    cfg = json.loads((SHAPES_DIR / "tiny-llama.json").read_text())
    cfg.update(hidden_size=2048, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=16,
               num_key_value_heads=8, head_dim=128)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 5, 40, 64)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens, calls, qkv_rope = {}, [], R.qkv_rope
    monkeypatch.setattr(R, "qkv_rope", lambda *a, **k: calls.append(1) or qkv_rope(*a, **k))  # counts, then runs it
    for on in (False, True):
        monkeypatch.setattr(R, "ENGINE", on)
        for eager in (True, False):
            calls.clear()
            with LLM(str(tmp_path), load_format="dummy", device="cuda", dtype="bfloat16", page_size=16,
                     num_kv_pages=256, enforce_eager=eager) as llm:
                tokens[on, eager] = [o.token_ids for o in llm.generate(ids, params)]
                assert (" rope" in cuda_linear.engine_linears(llm.model, llm.device)) == on
            assert bool(calls) == on  # the decode steps (or their capture) took it
    assert tokens[True, True] == tokens[False, True] and tokens[True, False] == tokens[False, False]
