"""The prefill-side method flashprefill_v2 against plain references written from
METHODS.md (and the choices its runtime file fixes), plus, for both prefill-side methods,
the engine: exactness when nothing is dropped and the combination rules
(h2o_prefill's kept sets: ``test_h2o_prefill_engine.py``).

References loop over heads, rows and tokens in float64 and import nothing they check.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparseengine import LLM, SamplingParams
from sparseengine import method_registry as registry
from sparseengine.attention.torch_ref import TorchAttentionProvider
from sparseengine.config import Config, ConfigError
from sparseengine.engine.step_context import BlockMask, LayerView, ScoreRows
from sparseengine.kernels.fused_ops import rotary_qk
from sparseengine.layers.attention import Attention
from sparseengine.methods import flashprefill_v2 as fp
from sparseengine.methods.flashprefill_v2 import FlashPrefillV2
from tests.methods.prefill_common import ENGINE, GREEDY, prompt_ids, ref_softmax_row

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/methods/conftest.py

FP_KNOBS = dict(flashprefill_block=16, flashprefill_min_len=0, flashprefill_sink_blocks=1,
                flashprefill_window_blocks=1, flashprefill_probe_blocks=2)
FP_TINY = dict(prefill_sparse_method="flashprefill_v2", **FP_KNOBS)


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------- references


def ref_block_mask(q, k, block, sink, window, probe, threshold):
    """flashprefill_v2 for one call: q [q_len, Hq, d] rows at positions L - q_len .. L - 1."""
    q_len, hq, d = q.shape
    length, hkv, _ = k.shape
    g = hq // hkv
    first, last, nkb = (length - q_len) // block, (length - 1) // block, -(-length // block)
    probe_rows = [p for p in range(length - q_len, length) if p // block > last - probe]
    mass = [[0.0] * nkb for _ in range(hq)]
    for h in range(hq):
        for p in probe_rows:
            probs = ref_softmax_row(q[p - (length - q_len), h], k[: p + 1, h // g], d)
            for t in range(p + 1):
                mass[h][t // block] += float(probs[t]) / len(probe_rows)
    keep = [[[j <= i and (j < sink or j >= i - window or mass[h][j] >= threshold) for j in range(nkb)]
             for i in range(first, last + 1)] for h in range(hq)]
    return torch.tensor(keep), torch.tensor(mass, dtype=torch.float64)


def ref_masked_attention(q, k, v, mask, block):
    """Rows at positions L - q_len .. L - 1; key t is read iff t <= p and (same block or
    mask[h, p // block - first, t // block]). -> [q_len, Hq, d] float64, probs [Hq, q_len, L]."""
    q_len, hq, d = q.shape
    length, hkv, _ = k.shape
    g = hq // hkv
    first = (length - q_len) // block
    out = torch.zeros(q_len, hq, d, dtype=torch.float64)
    probs = torch.zeros(hq, q_len, length, dtype=torch.float64)
    for h in range(hq):
        for i in range(q_len):
            p = length - q_len + i
            keys = [t for t in range(p + 1) if mask is None or t // block == p // block
                    or bool(mask[h, p // block - first, t // block])]
            pr = ref_softmax_row(q[i, h], k[keys, h // g], d)
            out[i, h] = pr @ v[keys, h // g].double()
            probs[h, i, keys] = pr
    return out, probs


def thresholds_between(mass):
    """Thresholds that fall between reference masses (no entry sits at the threshold)."""
    vals = sorted(set(round(float(x), 9) for x in mass.flatten()))
    mids = [(a + b) / 2 for a, b in zip(vals, vals[1:]) if b - a > 1e-6]
    return [mids[len(mids) // 4], mids[len(mids) // 2], mids[3 * len(mids) // 4]]


# ------------------------------------------------------- flashprefill_v2: definitions

# (L, q_len, Hq, Hkv, d, block, sink, window, probe)
SELECT_CASES = [
    (160, 160, 4, 2, 16, 16, 1, 1, 2),  # whole prompt in one pass
    (200, 72, 6, 2, 8, 16, 2, 1, 1),  # a chunk starting mid-block
    (130, 50, 4, 4, 16, 16, 0, 0, 3),  # no sink/window: diagonal + estimate only
    (257, 257, 9, 3, 8, 32, 1, 2, 2),  # SmolLM2's grouping, partial last block
]


@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: f"L{c[0]}q{c[1]}h{c[2]}/{c[3]}b{c[5]}")
def test_block_selection_matches_reference(case):
    length, q_len, hq, hkv, d, block, sink, window, probe = case
    q, k = rand(q_len, hq, d, seed=length) * 2, rand(length, hkv, d, seed=length + 1) * 2
    _, ref_mass = ref_block_mask(q, k, block, sink, window, probe, 0.0)
    r = length - fp.probe_start(q_len, length, block, probe)
    torch.testing.assert_close(fp.block_mass(q[q_len - r:], k, block).double(), ref_mass, atol=1e-5, rtol=1e-4)
    for thr in [0.0, 2.0] + thresholds_between(ref_mass):
        want, _ = ref_block_mask(q, k, block, sink, window, probe, thr)
        got = fp.flashprefill_mask(q, k, block, sink, window, probe, thr)
        assert torch.equal(got, want), f"threshold {thr}"
    all_causal, _ = ref_block_mask(q, k, block, sink, window, probe, 0.0)
    assert torch.equal(fp.flashprefill_mask(q, k, block, sink, window, probe, 0.0), all_causal)
    assert all_causal.sum() == sum(i + 1 for i in range((length - q_len) // block, (length - 1) // block + 1)) * hq


def _attend(provider, q, k_full, v_full, q_lens, lens, block_mask, score_rows=None, page_size=8, seed=0):
    """Run the provider on a paged cache built from per-request dense K/V (page tables shuffled)."""
    hkv, d = k_full[0].shape[1:]
    pages_per = [-(-n // page_size) for n in lens]
    perm = torch.randperm(sum(pages_per), generator=torch.Generator().manual_seed(seed))
    k_cache = torch.zeros(sum(pages_per), page_size, hkv, d)
    v_cache = torch.zeros_like(k_cache)
    table = torch.zeros(len(lens), max(pages_per), dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        table[b, : pages_per[b]] = perm[used: used + pages_per[b]]
        used += pages_per[b]
        for t in range(n):
            k_cache[table[b, t // page_size], t % page_size] = k_full[b][t]
            v_cache[table[b, t // page_size], t % page_size] = v_full[b][t]
    view = LayerView(slot_mapping=torch.zeros(0, dtype=torch.long), kv_lens=torch.tensor(lens, dtype=torch.int32),
                     kv_lens_list=tuple(lens), page_table=table)
    ctx = SimpleNamespace(q_lens=tuple(q_lens), is_decode=all(n == 1 for n in q_lens))
    extra = {} if block_mask is None else {"block_mask": block_mask}
    return provider.attend(q, k_cache, v_cache, ctx, view, None, score_rows, **extra)


@pytest.mark.parametrize("hq,hkv,block", [(4, 2, 16), (6, 3, 8)])
def test_provider_block_sparse_attention_matches_reference(hq, hkv, block):
    """The torch provider under a BlockMask (a chunk mid-prompt, a whole prompt, a dense
    request, a decode row) against the plain reference; with score rows too."""
    d, provider = 16, TorchAttentionProvider()
    lens, q_lens = [150, 70, 90, 40], [45, 70, 30, 1]
    ks = [rand(n, hkv, d, seed=10 + b) for b, n in enumerate(lens)]
    vs = [rand(n, hkv, d, seed=20 + b) for b, n in enumerate(lens)]
    q = rand(sum(q_lens), hq, d, seed=30) * 2
    masks = []
    for b, (n, ql) in enumerate(zip(lens, q_lens)):
        nq, nk = (n - 1) // block - (n - ql) // block + 1, -(-n // block)
        masks.append(torch.rand(hq, nq, nk, generator=torch.Generator().manual_seed(b)) < 0.4 if b < 2 else None)
    bm = BlockMask(block, tuple(masks))
    out, cs = _attend(provider, q, ks, vs, q_lens, lens, bm)
    out_scored, cs = _attend(provider, q, ks, vs, q_lens, lens, bm, ScoreRows((5, 70, 30, 0)))
    start = 0
    for b, (n, ql) in enumerate(zip(lens, q_lens)):
        want, probs = ref_masked_attention(q[start:start + ql], ks[b], vs[b], masks[b], block)
        torch.testing.assert_close(out[start:start + ql].double(), want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(out_scored[start:start + ql].double(), want, atol=1e-5, rtol=1e-4)
        rows = (5, 70, 30, 0)[b]
        ref_cs = probs[:, ql - rows:].sum(1).view(hkv, hq // hkv, n).mean(1)
        torch.testing.assert_close(cs[b].double(), ref_cs, atol=1e-5, rtol=1e-4)
        start += ql


def test_all_blocks_kept_is_exactly_dense():
    hq, hkv, d, block = 4, 2, 16, 16
    lens, q_lens = [150, 64], [45, 64]
    ks = [rand(n, hkv, d, seed=40 + b) for b, n in enumerate(lens)]
    vs = [rand(n, hkv, d, seed=50 + b) for b, n in enumerate(lens)]
    q = rand(sum(q_lens), hq, d, seed=60)
    full = tuple(torch.ones(hq, (n - 1) // block - (n - ql) // block + 1, -(-n // block), dtype=torch.bool)
                 for n, ql in zip(lens, q_lens))
    provider = TorchAttentionProvider()
    for rows in (None, ScoreRows((45, 3))):
        dense, cs_dense = _attend(provider, q, ks, vs, q_lens, lens, None, rows)
        sparse, cs_sparse = _attend(provider, q, ks, vs, q_lens, lens, BlockMask(block, full), rows)
        assert torch.equal(dense, sparse)
        if rows is not None:
            assert all(torch.equal(a, b) for a, b in zip(cs_dense, cs_sparse))


def test_method_reference_agrees_with_kernel_reference():
    """For a whole prompt the mask layout is the block-sparse kernel's [Hq, nb, nb]."""
    kernels = pytest.importorskip("sparseengine.kernels")
    q, k, v = rand(100, 4, 16, seed=1) * 2, rand(100, 2, 16, seed=2) * 2, rand(100, 2, 16, seed=3)
    mask = fp.flashprefill_mask(q, k, 16, 1, 1, 2, 0.08)
    assert 0 < mask.float().mean() < 1
    want, _ = ref_masked_attention(q, k, v, mask, 16)
    torch.testing.assert_close(fp.masked_attention(q, k, v, mask, 16).double(), want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(kernels.block_sparse_prefill_ref(q, k, v, mask, 16).double(), want,
                               atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------- flashprefill_v2: engine


def test_flashprefill_engine_masks_match_reference(tiny_llama, monkeypatch):
    """Every block mask the engine uses, chunk by chunk and layer by layer, is the
    reference's on the q/k the model computed; the stats report them."""
    folder, _ = tiny_llama
    calls, masks = [], []
    forward, block_mask = Attention.forward, FlashPrefillV2.block_mask

    def spy_forward(self, q, k, v, cos, sin):
        qr, kr = rotary_qk(q, k, cos, sin)  # what the layer attends with (it rotates them)
        calls.append((self.layer_id, qr.clone(), kr.clone()))
        return forward(self, q, k, v, cos, sin)

    def spy_mask(self, layer, q, ctx):
        bm = block_mask(self, layer, q, ctx)
        masks.append(None if bm is None else bm.masks[0])
        return bm

    monkeypatch.setattr(Attention, "forward", spy_forward)
    monkeypatch.setattr(FlashPrefillV2, "block_mask", spy_mask)
    thr = 0.1
    llm = LLM(str(folder), **ENGINE, prefill_chunk_size=48, **FP_TINY, flashprefill_threshold=thr,
              flashprefill_measure_error=True)
    prompt = prompt_ids(170)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    keys: dict[int, list] = {}
    computed = total = 0
    for (layer, q, k), got in zip(calls, masks):
        keys.setdefault(layer, []).append(k)
        kk = torch.cat(keys[layer])
        if kk.shape[0] > len(prompt):  # decode rows stay dense
            assert got is None
            continue
        want, _ = ref_block_mask(q, kk, 16, 1, 1, 2, thr)
        assert torch.equal(got, want), f"layer {layer}, {kk.shape[0]} tokens"
        computed += int(want.sum())
        total += sum(i + 1 for i in range((kk.shape[0] - q.shape[0]) // 16, (kk.shape[0] - 1) // 16 + 1)) * q.shape[1]
    stats = llm.method.parts[0].request_stats(out.request_id)
    assert stats["sparse"] and stats["blocks_computed"] == computed and stats["blocks_total"] == total
    assert 0 < stats["block_fraction"] < 1
    assert 0 < stats["attn_rel_error"] <= stats["attn_max_rel_error"]
    assert llm.method.parts[0].summary()["requests"] == 1
    llm.close()


def test_flashprefill_short_prompt_runs_dense(tiny_llama):
    folder, _ = tiny_llama
    kw = {**FP_TINY, "flashprefill_min_len": 100}
    llm = LLM(str(folder), **ENGINE, **kw, flashprefill_threshold=1.0)
    out = llm.generate(prompt_ids(80), GREEDY)[0]
    stats = llm.method.parts[0].request_stats(out.request_id)
    assert stats["sparse"] is False and stats["block_fraction"] == 1.0 and stats["attn_rel_error"] == 0.0
    llm.close()


# ------------------------------------------------------------ exact when nothing drops

EXACT = [
    ("h2o_prefill", "vanilla", dict(h2o_prefill_budget=4096)),
    ("h2o_prefill", "h2o", dict(h2o_prefill_budget=4096, budget=4096)),
    ("h2o_prefill", "vanilla", dict(h2o_prefill_budget=150, sink_tokens=4, recent_tokens=8)),  # budget = prompt
    ("flashprefill_v2", "vanilla", dict(FP_KNOBS, flashprefill_threshold=0.0)),
    ("flashprefill_v2", "vanilla", dict(FP_KNOBS, flashprefill_threshold=0.0, prefill_chunk_size=512)),
    ("flashprefill_v2", "snapkv", dict(FP_KNOBS, flashprefill_threshold=0.0)),
    ("flashprefill_v2", "h2o", dict(FP_KNOBS, flashprefill_threshold=0.0)),
    ("flashprefill_v2", "omnikv", dict(FP_KNOBS, flashprefill_threshold=0.0, omnikv_filter_layers="1")),
    ("flashprefill_v2", "quest", dict(FP_KNOBS, flashprefill_threshold=0.0, quest_page_size=8)),
]


@pytest.fixture(scope="module")
def vanilla_tokens(tiny_llama):
    folder, _ = tiny_llama
    with LLM(str(folder), **ENGINE, prefill_chunk_size=40) as llm:
        return [o.token_ids for o in llm.generate([prompt_ids(150), prompt_ids(90, seed=2)], GREEDY)]


@pytest.mark.parametrize("pre,decode,kw", EXACT, ids=[f"{p}+{d}-{i}" for i, (p, d, _) in enumerate(EXACT)])
def test_keeping_everything_is_vanilla(tiny_llama, vanilla_tokens, pre, decode, kw):
    folder, _ = tiny_llama
    kw = {"prefill_chunk_size": 40, **kw}
    with LLM(str(folder), **ENGINE, sparse_method=decode, prefill_sparse_method=pre, **kw) as llm:
        outs = llm.generate([prompt_ids(150), prompt_ids(90, seed=2)], GREEDY)
        assert [o.token_ids for o in outs] == vanilla_tokens
        if pre == "flashprefill_v2":
            stats = llm.method.parts[0].summary()
            assert stats["sparse"] and stats["block_fraction"] == 1.0


# ------------------------------------------------------------------------ configuration


@pytest.mark.parametrize("pre", ["h2o_prefill", "flashprefill_v2"])
def test_incompatible_pairs_name_both(pre):
    allowed = registry.get_spec(pre, "prefill").combines_with
    bad = [m for m in registry.decode_methods() if m not in allowed]
    assert bad
    for decode in bad:
        with pytest.raises(ConfigError) as err:
            Config.from_kwargs(sparse_method=decode, prefill_sparse_method=pre)
        assert f"'{pre}'" in str(err.value) and f"'{decode}'" in str(err.value)
    for decode in allowed:
        Config.from_kwargs(sparse_method=decode, prefill_sparse_method=pre)


def test_config_errors(tiny_llama):
    folder, _ = tiny_llama
    with pytest.raises(ConfigError, match="flashprefill_threshold"):  # no table entry for this model
        LLM(str(folder), **ENGINE, prefill_sparse_method="flashprefill_v2")
    with pytest.raises(ConfigError, match="flashprefill_block"):
        LLM(str(folder), **ENGINE, prefill_sparse_method="flashprefill_v2", flashprefill_threshold=0.01,
            flashprefill_block=24)
    with pytest.raises(ConfigError, match="h2o_prefill_budget"):
        LLM(str(folder), **ENGINE, prefill_sparse_method="h2o_prefill", h2o_prefill_budget=100,
            sink_tokens=64, recent_tokens=64)
    assert "smollm2-135m-instruct" in fp.THRESHOLDS
