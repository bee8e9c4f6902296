"""The model's decode-step linears: gate_up's rows interleaved for the CUDA kernel's gated
epilogue leave the model's function on every path (the CPU's torch path here), and on the
H200 a model whose layers `cuda_linear` takes gives the Triton path's logits, and its decode
graphs replay its eager tokens, with the kernel in its records."""
from __future__ import annotations

import json

import pytest
import torch

from sparseengine import LLM, SamplingParams
from sparseengine.kernels import cuda_linear
from sparseengine.models.loader import SHAPES_DIR
from tests.test_hf_equivalence import hf_greedy, rel_err


def test_interleaved_gate_up_is_the_same_model(tiny_llama):
    folder, hf = tiny_llama
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (7, 30)]
    with LLM(str(folder), dtype="float32", page_size=8, kv_cache_memory=0.01) as llm:
        before = llm.prompt_logits(ids)
        w = llm.model.layers[1].mlp.gate_up_proj.weight.clone()
        llm.model.interleave_gate_up()
        assert all(layer.mlp.gate_group == cuda_linear.GATE_GROUP for layer in llm.model.layers)
        assert not torch.equal(llm.model.layers[1].mlp.gate_up_proj.weight, w)  # the rows moved
        for got, want in zip(llm.prompt_logits(ids), before):
            assert rel_err(got, want) < 1e-6
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        assert [o.token_ids for o in outs] == [hf_greedy(hf, i, 10) for i in ids]
        with pytest.raises(RuntimeError, match="interleaved already"):
            llm.model.layers[0].mlp.interleave_gate_up()


def _mid_llama(tmp_path) -> str:
    """A two-layer Llama whose layers the CUDA kernel takes (K = 2048 and 4096), dummy weights."""
    cfg = json.loads((SHAPES_DIR / "tiny-llama.json").read_text())
    cfg.update(hidden_size=2048, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=16,
               num_key_value_heads=8, head_dim=128)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.gpu
def test_cuda_linears_in_the_engine(tmp_path, monkeypatch):
    """A model whose layers the kernel takes: prompts of at most 8 tokens run their linears
    through it, and their logits are the Triton path's within bf16 rounding (the sums run in
    another order, so the tokens of a long generation may part at a near tie); its decode
    graphs replay its eager steps token for token; the records name it."""
    reason = cuda_linear.unavailable("cuda")
    assert reason is None, reason
    folder = _mid_llama(tmp_path)
    gen = torch.Generator().manual_seed(4)
    short = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 5, 8)]
    ids = short + [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (40, 17, 64)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    logits, tokens = {}, {}
    for engine in (False, True):
        monkeypatch.setattr(cuda_linear, "ENGINE", engine)
        for eager in (True, False):
            with LLM(folder, load_format="dummy", device="cuda", dtype="bfloat16", page_size=16, num_kv_pages=256,
                     enforce_eager=eager) as llm:
                mlp = llm.model.layers[0].mlp
                assert mlp.gate_group == (cuda_linear.GATE_GROUP if engine else 0)
                x = torch.zeros(6, 2048, dtype=torch.bfloat16, device="cuda")
                assert cuda_linear.takes(x, mlp.gate_up_proj.weight) == engine
                assert cuda_linear.engine_linears(llm.model, llm.device).startswith("cuda<=8 rows pdl gated") == engine
                logits[engine] = llm.prompt_logits(short)
                tokens[engine, eager] = [o.token_ids for o in llm.generate(ids, params)]
                assert (llm.runner.graph_steps > 0) != eager
    for got, want in zip(logits[True], logits[False]):
        assert rel_err(got.float(), want.float()) < 2e-2
    assert tokens[True, True] == tokens[True, False]  # the graphs replay the eager launches


@pytest.mark.gpu
def test_a_prefill_mlp_makes_no_deinterleaved_copy():
    """With gate_up interleaved, a prefill step's MLP (rows past the CUDA kernel: cuBLAS, then
    the SiLU-and-multiply) reads gate_up's output in place. The step's peak memory sizes the
    KV pool (`pool_budget.warmup_peak_bytes`): a de-interleaved copy of the [T, 2I] output
    took ~1 GB of pool at the 128K benchmark's 16K-token steps (session 43)."""
    from types import SimpleNamespace

    from sparseengine.models.llama import MLP

    T, H, inter = 4096, 2048, 8192
    mlp = MLP(SimpleNamespace(hidden_size=H, intermediate_size=inter)).to("cuda", torch.bfloat16)
    mlp.interleave_gate_up()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    mlp(x)  # warm-up: cuBLAS's workspace, the kernel's compile
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    mlp(x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    y, h, out = T * 2 * inter * 2, T * inter * 2, T * H * 2  # gate_up's output, the SiLU's, down's
    assert peak < y + h + out + y // 2, f"peak {peak / 2**20:.0f} MiB: a copy of gate_up's {y / 2**20:.0f} MiB?"
