"""DeltaKV in the engine, on a tiny random Llama: calibrate (through the calibration
function), reload the checkpoint, generate.

- budget covering the prompt: equal to vanilla token for token;
- lossless latents (16-bit, latent dim = K|V dim): equal to OmniKV with the same filter
  layers token for token, across a history flush and a mixed prefill/decode batch;
- reconstruction error of rebuilt K/V against a vanilla run's dense cache below the bound
  of deltakv_codec's docstring, ``||R - R_hat||_F <= sqrt(sum_{i>r} s_i^2) + ||dz||_F``.
  Calibrating on the test prompt itself makes it exact: the rebuilt rows are a subset of
  the calibration rows, and a subset's projection error is at most the whole set's;
  RoPE is orthogonal, so the error is the same before and after rotation;
- a missing or mismatched checkpoint is a ConfigError that says how to make one;
- stored bytes against a hand count.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparseengine import LLM, ConfigError, SamplingParams
from sparseengine.methods import deltakv, deltakv_bytes, deltakv_fit
from sparseengine.methods import deltakv_codec as codec
from sparseengine.methods.deltakv_calibrate import calibrate, layer_kv, prefill_kv

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/methods/conftest.py

SINK, RECENT, BUDGET = 4, 16, 24
FULL = "1"  # tiny-llama has 4 layers: 0 and 1 keep full KV, 2 and 3 are compressed
SPARSE = (2, 3)
HKV, HEAD_DIM = 2, 16
DIM = 2 * HKV * HEAD_DIM  # 64


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT = _ids(200, 1)
PROMPT2 = _ids(150, 2)


@pytest.fixture(scope="module")
def folder(tiny_llama):
    return str(tiny_llama[0])


@pytest.fixture(scope="module")
def ckpt64(folder, tmp_path_factory):
    """Calibrated on PROMPT with the full latent dim."""
    path = tmp_path_factory.mktemp("deltakv") / "tiny64.safetensors"
    result = calibrate(folder, token_ids=PROMPT, out=path, latent_dim=DIM, sink_tokens=SINK, progress=False,
                       device="cpu")
    return result


@pytest.fixture(scope="module")
def ckpt32(folder, tmp_path_factory):
    path = tmp_path_factory.mktemp("deltakv") / "tiny32.safetensors"
    return calibrate(folder, token_ids=PROMPT + PROMPT2, out=path, latent_dim=32, sink_tokens=SINK,
                     segment_tokens=200, progress=False, device="cpu")


def _llm(folder, method="deltakv", **kw):
    base = dict(device="cpu", num_kv_pages=128, sink_tokens=SINK, recent_tokens=RECENT, budget=BUDGET)
    if method == "deltakv":
        base["deltakv_full_layers"] = FULL
    if method == "omnikv":
        base["omnikv_filter_layers"] = FULL
    return LLM(folder, sparse_method=method, **{**base, **kw})


def _greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


# --------------------------------------------------------------------------- calibration


def test_calibration_writes_a_checkpoint_the_codec_reloads(ckpt64, ckpt32, folder):
    for result, r in ((ckpt64, DIM), (ckpt32, 32)):
        layers, meta = deltakv_fit.load_checkpoint(result.path)
        assert sorted(layers) == [0, 1, 2, 3]  # every layer: any deltakv_full_layers works
        assert meta["latent_dim"] == r and meta["neighbors"] == 4 and meta["center_ratio"] == 0.1
        assert meta["model_name"] == LLM(folder, device="cpu", num_kv_pages=4).model_config.name
        assert meta["sink_tokens"] == str(SINK)
        for down, up in layers.values():
            assert down.shape == (DIM, r) and up.shape == (r, DIM)
            torch.testing.assert_close(down.T @ down, torch.eye(r), atol=1e-5, rtol=0)  # orthonormal
        assert all(0 < e <= 1 + 1e-9 for e in result.energy_kept)
    assert ckpt64.energy_kept == pytest.approx([1.0] * 4)
    assert ckpt32.tokens == 350 and ckpt32.meta["segments"] == 2


# ------------------------------------------------------------------------------ exactness


def test_a_synthesised_history_keeps_growing(folder, ckpt32):
    """A synthesised prefill builds the codec under the runner's inference mode; the
    flushes after it (outside that mode) still append to it."""
    llm = _llm(folder, deltakv_latent_dim=32, deltakv_checkpoint_path=str(ckpt32.path))
    rt, sizes = llm.method, []
    finish = rt.finish_step

    def spy(batch):
        finish(batch)
        sizes.append(rt.cache.state(batch.seqs[0])["deltakv"].stores[SPARSE[0]].n)

    rt.finish_step = spy
    outs = llm.generate([PROMPT], _greedy(70), prefill="synthesized")
    assert len(outs[0].token_ids) == 70
    hist = len(PROMPT) - SINK - RECENT
    assert sizes[0] == hist and sizes[-1] == hist + 64  # one flush of 64 decoded tokens


def test_graph_key_follows_what_a_captured_step_bakes_in(folder, ckpt32):
    """A request's graph key changes when its layers are first compressed and when its
    codec buffers move, not at the flushes that append within their capacity."""
    llm = _llm(folder, deltakv_latent_dim=32, deltakv_checkpoint_path=str(ckpt32.path))
    rt, keys = llm.method, []
    finish = rt.finish_step

    def spy(batch):
        finish(batch)
        seq = batch.seqs[0]
        keys.append((seq.num_computed_tokens, rt.graph_key([seq])[0][1:]))

    rt.finish_step = spy
    llm.generate([_ids(30, 4)], _greedy(100))  # 30 tokens: within the total (44) until decoding passes it
    first = next(i for i, (_, k) in enumerate(keys) if k[0])  # compressed from here on
    assert keys[first - 1][1] == (False, ())
    assert keys[first][0] > SINK + BUDGET + RECENT and len(keys[first][1][1]) == len(SPARSE)
    assert {k for _, k in keys[first:]} == {keys[first][1]}  # later flushes append in place
    assert sum(1 for a, b in zip(keys, keys[1:]) if a[1] != b[1]) == 1


def test_pure_decode_path_equals_the_per_request_path(folder, ckpt32, monkeypatch):
    """Pure-decode steps choose from the full layer's own attention (max logits, batched,
    no host sync); with that path off, every step chooses request by request from K
    gathered again. Both map the choice through the same rebuild. With lossy int4
    latents, through a history flush, they generate the same tokens."""
    prompts, sp = [PROMPT, PROMPT2, _ids(20, 3)], _greedy(70)  # 20 tokens: within the total at first
    kw = dict(deltakv_latent_dim=32, deltakv_checkpoint_path=str(ckpt32.path))
    llm = _llm(folder, **kw)
    calls = []
    batched = llm.method._batched_selection
    llm.method._batched_selection = lambda layer, ctx: (calls.append(layer), batched(layer, ctx))[1]
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert len(calls) >= 2 * 60  # both sparse layers, every pure-decode step
    monkeypatch.setattr(deltakv.omnikv, "pure_decode", lambda ctx: False)
    assert got == [o.token_ids for o in _llm(folder, **kw).generate(prompts, sp)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels on CPU tensors: the interpreter, "
                    "which tests/conftest.py sets only on a machine without CUDA")
@pytest.mark.parametrize("one_launch", [True, False])
def test_fused_rebuild_equals_the_torch_path(folder, ckpt32, monkeypatch, one_launch):
    """On a Triton provider the sparse layers rebuild through the fused kernel (interpreted
    here): in pure-decode steps every request's entries of a layer in one launch (or, with
    ``ONE_LAUNCH_PER_LAYER`` off, a launch per request), in the mixed step where one
    prompt's last chunk meets the other's decoding a launch per request. The tokens equal
    those of the torch provider, which rebuilds through the codec."""
    prompts, sp = [PROMPT, PROMPT2], _greedy(12)
    kw = dict(deltakv_latent_dim=32, deltakv_checkpoint_path=str(ckpt32.path), prefill_chunk_size=64)
    want = [o.token_ids for o in _llm(folder, attention_provider="torch", **kw).generate(prompts, sp)]
    monkeypatch.setattr(deltakv.deltakv_rebuild, "ONE_LAUNCH_PER_LAYER", one_launch)
    per_request, batched = [], []
    kernel, batch_kernel = deltakv.kernels.deltakv_rebuild_triton, deltakv.kernels.deltakv_rebuild_batched_triton
    monkeypatch.setattr(deltakv.kernels, "deltakv_rebuild_triton",
                        lambda *a, **k: (per_request.append(int((a[4] >= 0).sum())), kernel(*a, **k))[1])
    monkeypatch.setattr(deltakv.kernels, "deltakv_rebuild_batched_triton",
                        lambda *a, **k: (batched.append((a[4] >= 0).sum(1).tolist()), batch_kernel(*a, **k))[1])
    got = [o.token_ids for o in _llm(folder, attention_provider="triton", **kw).generate(prompts, sp)]
    assert got == want
    if one_launch:  # both sparse layers, every pure-decode step, both requests' entries in each launch
        assert len(batched) >= 2 * 10 and [BUDGET, BUDGET] in batched and len(per_request) < len(batched)
    else:
        assert not batched and len(per_request) >= 2 * 2 * 11 and max(per_request) == BUDGET


def test_budget_covering_the_prompt_equals_vanilla(folder, ckpt32):
    prompts, sp = [PROMPT, PROMPT2], _greedy(8)
    want = [o.token_ids for o in _llm(folder, "vanilla").generate(prompts, sp)]
    llm = _llm(folder, deltakv_latent_dim=32, deltakv_checkpoint_path=str(ckpt32.path), budget=len(PROMPT))
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    assert all(b.latents == 0 for b in llm.method.bytes_at_end.values())  # nothing was compressed


def test_lossless_latents_equal_omnikv(folder, ckpt64):
    """16-bit latents at the full K|V dim rebuild tokens exactly (up to float16 latents),
    so DeltaKV must choose and attend exactly as OmniKV with the same filter layers —
    through a history flush (80 decode steps > RECENT + 64) and a batch mixing one
    request's prefill chunks with the other's decode."""
    prompts, sp = [PROMPT, PROMPT2], _greedy(80)
    kw = dict(prefill_chunk_size=64)
    want = [o.token_ids for o in _llm(folder, "omnikv", **kw).generate(prompts, sp)]
    llm = _llm(folder, deltakv_latent_dim=DIM, deltakv_latent_bits=16, deltakv_checkpoint_path=str(ckpt64.path),
               **kw)
    rt, ends = llm.method, set()
    flush = rt._flush

    def spy(seq):
        flush(seq)
        st = rt.cache.state(seq).get("deltakv")
        if st is not None and st.compressed:
            ends.add((seq.seq_id, st.hist_end))

    rt._flush = spy
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    # each request: its prompt history (n - RECENT), then one flush of 64 decoded tokens
    assert sorted(e for _, e in ends) == sorted([len(PROMPT) - RECENT, len(PROMPT) - RECENT + 64,
                                                len(PROMPT2) - RECENT, len(PROMPT2) - RECENT + 64])
    assert got != [o.token_ids for o in _llm(folder, "vanilla").generate(prompts, sp)]  # the budget bites


# ------------------------------------------------------------------------ reconstruction


def _dropped_energy(kv_hist: torch.Tensor, r: int) -> tuple[float, float]:
    res, _ = codec.residuals(kv_hist, 0.1, 4)
    s = torch.linalg.svdvals(res.double())
    return float((s[r:] ** 2).sum()), float(res.double().norm())


@pytest.mark.parametrize("r,bits", [(DIM, 16), (32, 16), (32, 4)])
def test_rebuilt_kv_error_within_the_derived_bound(folder, ckpt64, r, bits):
    dense = prefill_kv(_llm(folder, "vanilla"), PROMPT)  # rotated K and V per layer, as cached
    llm = _llm(folder, deltakv_latent_dim=r, deltakv_latent_bits=bits, deltakv_checkpoint_path=str(ckpt64.path))
    rt, records = llm.method, []
    rebuild = rt.rebuild

    def spy(seq, layer, tokens, **kw):
        """Each distinct token rebuilt. The pure-decode path rebuilds every chosen entry,
        its position clamped into the history (a sink or raw-tail pick rebuilds the first
        or last history token, and is not written): at most BUDGET + 2 distinct ones."""
        k, v = rebuild(seq, layer, tokens, **kw)
        uniq, inverse = torch.unique(tokens, return_inverse=True)
        first = torch.full_like(uniq, tokens.numel()).scatter_reduce(0, inverse, torch.arange(tokens.numel()), "amin")
        records.append((layer, tokens[first], k[first], v[first], rt.cache.state(seq)["deltakv"].enc[layer]))
        return k, v

    rt.rebuild = spy
    llm.generate(PROMPT, _greedy(4))
    assert {rec[0] for rec in records} == set(SPARSE) and len(records) == 2 * 3  # 3 decode steps
    inv_freq = rt.inv_freq
    res_all = {layer: codec.residuals(layer_kv(*dense[layer], inv_freq)[SINK:], 0.1, 4)[0] for layer in SPARSE}
    for layer, tokens, k, v, enc in records:
        assert 0 < tokens.numel() <= BUDGET + 2 and bool(((tokens >= SINK) & (tokens < len(PROMPT) - RECENT)).all())
        kd, vd = dense[layer]
        err = math.sqrt(float((k - kd[tokens]).double().pow(2).sum() + (v - vd[tokens]).double().pow(2).sum()))
        # The bound: projection error of the calibration residuals (this prompt's
        # history tokens S.. n-1, a superset of the rebuilt ones) + latent storage error.
        dropped, res_norm = _dropped_energy(layer_kv(kd, vd, inv_freq)[SINK:], r)
        if bits == 16:
            dz = 2.0 ** -11 * res_norm  # |dz| <= 2^-11 |z| and ||z|| <= ||R|| (orthonormal Down)
        else:
            dz = math.sqrt(float((QUANT_GROUP_BOUND * enc.scales.double().pow(2)).sum()))
        bound = math.sqrt(dropped) + dz + 1e-5 * res_norm + 1e-5  # + float32 rotate/unrotate
        assert err <= bound, (layer, err, bound)
        # Tighter, for these very rows: their own projection error + their latent error.
        j = tokens - SINK  # codec positions
        centers = j % 10 == 0
        assert float((k - kd[tokens])[centers].abs().sum()) < 1e-4 * max(1, int(centers.sum()))  # raw centers
        rows = j[~centers] - j[~centers] // 10 - 1
        res_sub = res_all[layer][rows].double()
        down = rt.down[layer].double()
        proj_err = float((res_sub - res_sub @ down @ down.T).norm())
        if bits == 16:
            dz_sub = 2.0 ** -11 * float(res_sub.norm())
        else:
            dz_sub = math.sqrt(float((QUANT_GROUP_BOUND * enc.scales[rows].double().pow(2)).sum()))
        assert err <= proj_err + dz_sub + 1e-5 * res_norm + 1e-5, (layer, err, proj_err, dz_sub)
        if r == DIM and bits == 16:  # full latent dim, 16-bit latents: exact up to float16 z
            ref = math.sqrt(float(kd[tokens].double().pow(2).sum() + vd[tokens].double().pow(2).sum()))
            assert err <= 1e-3 * ref
        else:
            assert err > 0


QUANT_GROUP_BOUND = codec.QUANT_GROUP / 4  # int4: |dz| <= scale / 2 on each of a group's 32 values


# ----------------------------------------------------------------------------- errors


def test_missing_or_mismatched_checkpoint_is_a_config_error(folder, ckpt64, ckpt32, tmp_path):
    with pytest.raises(ConfigError, match=r"deltakv_checkpoint_path.*python -m sparseengine.methods.deltakv_calibrate"):
        _llm(folder)
    with pytest.raises(ConfigError, match="does not exist.*deltakv_calibrate"):
        _llm(folder, deltakv_checkpoint_path=str(tmp_path / "nope.safetensors"))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="not a DeltaKV checkpoint"):
        _llm(folder, deltakv_checkpoint_path=str(junk))
    with pytest.raises(ConfigError, match="deltakv_latent_dim=256 exceeds the checkpoint's latent dim 32"):
        _llm(folder, deltakv_checkpoint_path=str(ckpt32.path))
    with pytest.raises(ConfigError, match="deltakv_neighbors=4, the engine runs 2"):
        _llm(folder, deltakv_latent_dim=32, deltakv_neighbors=2, deltakv_checkpoint_path=str(ckpt32.path))
    with pytest.raises(ConfigError, match="deltakv_center_ratio"):
        _llm(folder, deltakv_latent_dim=32, deltakv_center_ratio=0.25, deltakv_checkpoint_path=str(ckpt32.path))
    with pytest.raises(ConfigError, match="deltakv_latent_bits"):
        _llm(folder, deltakv_latent_dim=32, deltakv_latent_bits=8, deltakv_checkpoint_path=str(ckpt32.path))
    with pytest.raises(ConfigError, match="no default deltakv_full_layers"):
        _llm(folder, deltakv_full_layers="", deltakv_checkpoint_path=str(ckpt32.path))


# ------------------------------------------------------------------------------ bytes


def test_stored_bytes_against_a_hand_count(folder, ckpt32):
    out_tokens = 10
    llm = _llm(folder, deltakv_latent_dim=32, deltakv_checkpoint_path=str(ckpt32.path))
    out = llm.generate(PROMPT, _greedy(out_tokens))[0]
    got = llm.method.bytes_at_end[out.request_id]
    n = len(PROMPT)
    tokens = n + out_tokens - 1  # the last sampled token is never fed
    tb = DIM * 4  # float32 K|V of one token in one layer
    hist = n - SINK - RECENT  # compressed at prefill end; no flush before RECENT + 64 more tokens
    centers = -(-hist // 10)
    others = hist - centers
    per_latent = 32 // 2 + (32 // 32) * 2 * 2  # int4 codes + float16 scale and min per group of 32
    tail = tokens - (n - RECENT)
    assert got.tokens == tokens
    assert got.dense == tokens * 4 * tb
    assert got.full_layers == 2 * tokens * tb  # layers 0 and 1
    assert got.raw_sparse == 2 * (SINK + BUDGET + tail) * tb  # layers 2 and 3
    assert got.centers == 2 * centers * DIM * 4
    assert got.latents == 2 * others * per_latent
    assert got.indices == 2 * others * 4 * 2  # 4 int16 neighbour indices
    acct = deltakv_bytes.stored_bytes_per_token(hist, HKV, HEAD_DIM, 32, 0.1, 4, 4, kv_bytes=4)
    assert got.centers + got.latents + got.indices == 2 * acct.stored_bytes
    assert got.pool == -(-tokens // 16) * 16 * 4 * tb
    assert got.stored == got.full_layers + got.raw_sparse + got.centers + got.latents + got.indices
    assert got.ratio == pytest.approx(got.stored / got.dense)
    assert out.metrics["kv_tokens"] == pytest.approx((2 * tokens + 2 * (SINK + BUDGET + tail)) / 4)


# ------------------------------------------------------------- decode-benchmark hooks


def test_cache_lens_and_synthesized_prefill(folder, ckpt32):
    llm = _llm(folder, deltakv_latent_dim=32, deltakv_checkpoint_path=str(ckpt32.path))
    rt, after_prefill = llm.method, {}
    flush = rt._flush

    def spy(seq):
        flush(seq)
        after_prefill.setdefault(seq.seq_id, list(seq.layer_lens))

    rt._flush = spy
    outs = llm.generate([PROMPT, _ids(30, 3)], _greedy(2))
    assert after_prefill[outs[0].request_id] == rt.cache_lens_after_prefill(len(PROMPT)) == [200, 200, 44, 44]
    assert after_prefill[outs[1].request_id] == rt.cache_lens_after_prefill(30) == [30] * 4
    # a synthesised prefill (random KV and codec state) decodes like a real one
    reads = []
    rebuild = rt.rebuild

    def spy_rebuild(seq, layer, tokens, **kw):
        reads.append((rt.tokens_read(seq), rt.metadata_bytes_read(seq, 128)))
        return rebuild(seq, layer, tokens, **kw)

    rt.rebuild = spy_rebuild
    outs = llm.generate([PROMPT, PROMPT2], _greedy(5), prefill="synthesized")
    assert [len(o.token_ids) for o in outs] == [5, 5] and {o.finish_reason for o in outs} == {"length"}
    assert reads and all(r[0][2:] == [SINK + BUDGET + RECENT] * 2 and r[1] > 0 for r in reads)
