"""The engine matches Hugging Face transformers token for token (float32, greedy)."""

from __future__ import annotations

import pytest
import torch

from sparseengine import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea. The waves",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In 1969, the Apollo 11 mission landed on the Moon. The astronauts were Neil Armstrong, "
    "Buzz Aldrin and Michael Collins. After landing, they",
]
NEW_TOKENS = 32


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    from transformers import GenerationConfig

    x = torch.tensor([ids])
    hf.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n)
    assert out.shape[1] == len(ids) + n
    return out[0, len(ids):].tolist()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_smollm2_batch_matches_hf_generate(smollm2, hf_smollm2):
    ids = [smollm2.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids), "prompts must differ in length"
    outs = smollm2.generate(ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt_ids, out in zip(ids, outs):
        assert out.finish_reason == "length"
        assert out.token_ids == hf_greedy(hf_smollm2, prompt_ids, NEW_TOKENS)


def test_smollm2_prompt_logits_match_hf(smollm2, hf_smollm2):
    ids = [smollm2.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    for got, prompt_ids in zip(smollm2.prompt_logits(ids), ids):
        assert rel_err(got, hf_logits(hf_smollm2, prompt_ids)) < 1e-4


def test_string_prompts_and_text(smollm2, hf_smollm2):
    out = smollm2.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    ids = smollm2.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    assert out.prompt_token_ids == ids
    assert out.text == smollm2.tokenizer.decode(hf_greedy(hf_smollm2, ids, 8), skip_special_tokens=True)
    assert out.metrics["prompt_tokens"] == len(ids) and out.metrics["output_tokens"] == 8
    assert out.metrics["ttft_s"] > 0 and out.metrics["decode_s"] >= 0


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_tiny_random_models_match_hf(fixture, request):
    folder, hf = request.getfixturevalue(fixture)
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 40, 64)]
    with LLM(str(folder), dtype="float32", page_size=8, kv_cache_memory=0.01) as llm:
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        for prompt_ids, out in zip(ids, outs):
            assert out.token_ids == hf_greedy(hf, prompt_ids, NEW_TOKENS)
        for got, prompt_ids in zip(llm.prompt_logits(ids), ids):
            assert rel_err(got, hf_logits(hf, prompt_ids)) < 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_qwen2_bias_and_mistral_match_hf(arch, tmp_path):
    """Qwen2.5 (q/k/v bias) and Mistral (full attention) through the same model code."""
    import transformers

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
        hf = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.MistralConfig(**common, sliding_window=None)
        hf = transformers.MistralForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.1) if "norm" not in name else p.uniform_(0.8, 1.2)
    hf.eval().save_pretrained(tmp_path)
    ids = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 30)]
    with LLM(str(tmp_path), dtype="float32", page_size=8, kv_cache_memory=0.01) as llm:
        assert llm.model_config.qkv_bias == (arch == "qwen2")
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        for prompt_ids, out in zip(ids, outs):
            assert out.token_ids == hf_greedy(hf, prompt_ids, 12)
        for got, prompt_ids in zip(llm.prompt_logits(ids), ids):
            assert rel_err(got, hf_logits(hf, prompt_ids)) < 1e-4


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_folded_norms_are_the_same_model(fixture, request):
    """`fold_norms` (each norm's weight into the linear after it, the residual adds into the
    linears before them; on a GPU the decode steps' kernels apply them) leaves the model's
    function: its prompt logits within float32 rounding and HF's greedy tokens, here through
    the torch path of the folded layers."""
    folder, hf = request.getfixturevalue(fixture)
    gen = torch.Generator().manual_seed(2)
    ids = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 33)]
    with LLM(str(folder), dtype="float32", page_size=8, kv_cache_memory=0.01) as llm:
        before = llm.prompt_logits(ids)
        norm = llm.model.layers[0].input_layernorm.weight
        assert not torch.all(norm == 1)  # the fixture's norms are not unit: the fold has work to do
        llm.model.fold_norms()
        assert all(layer.norms_folded for layer in llm.model.layers) and torch.all(norm == 1)
        for got, want in zip(llm.prompt_logits(ids), before):
            assert rel_err(got, want) < 1e-5
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert [o.token_ids for o in outs] == [hf_greedy(hf, i, 12) for i in ids]
        with pytest.raises(RuntimeError, match="folded already"):
            llm.model.fold_norms()


@pytest.mark.gpu
@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("switches", [False, True])
def test_tiny_random_models_on_gpu_match_hf(fold, switches, tiny_llama, monkeypatch):
    """On a GPU the decode steps' linears run the Triton kernel, with the RMSNorms and residual
    adds folded into them (`skinny_linear.FOLD_NORMS`, read when the model loads) or not:
    still HF's greedy tokens (float32), eager and through the decode graphs. `switches`: the
    decode-step switches on (their default since session 21) or all off (TMA weight loads,
    the greedy argmax kernel, the reserved cos/sin table)."""
    from sparseengine.kernels import fused_ops, row_argmax, skinny_linear

    monkeypatch.setattr(skinny_linear, "FOLD_NORMS", fold)
    for module, name in ((skinny_linear, "TMA_LOADS"), (row_argmax, "SAMPLER_USES_KERNEL"),
                         (fused_ops, "ROTARY_TABLE")):
        monkeypatch.setattr(module, name, switches)
    folder, hf = tiny_llama
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 40, 64)]
    want = [hf_greedy(hf, prompt_ids, NEW_TOKENS) for prompt_ids in ids]
    for eager in (True, False):
        with LLM(str(folder), device="cuda", dtype="float32", page_size=8, num_kv_pages=256,
                 enforce_eager=eager) as llm:
            assert all(layer.norms_folded == fold for layer in llm.model.layers)
            outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
            assert [o.token_ids for o in outs] == want
            assert (llm.runner.graph_steps > 0) != eager
