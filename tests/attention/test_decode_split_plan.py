"""``decode_split_plan``: the engine knob that picks the Triton split-K decode's plan.

- ``per_row`` reaches every decode launch (never the balanced plan), ``auto`` takes the
  balanced plan where the split plan cuts rows by their own lengths, and both generate the
  torch provider's tokens on a ragged batch (the interpreter runs the Triton kernels here);
- a value it does not know, or any choice but ``auto`` on a provider without a split plan,
  is a ConfigError that names the fix.
"""

from __future__ import annotations

import pytest
import torch

from sparseengine import LLM, ConfigError, SamplingParams
from sparseengine.attention.provider import make_provider
from sparseengine.kernels import balanced_plan

PROMPTS = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (150, 9, 40)]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32", kv_cache_memory=0.01, page_size=8)


def _tokens(folder, **kw):
    with LLM(str(folder), **CPU, **kw) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels on CPU tensors: the interpreter, "
                    "which tests/conftest.py sets only on a machine without CUDA")
def test_each_plan_reaches_the_decode_launches_and_gives_the_torch_tokens(tiny_llama, monkeypatch):
    want = _tokens(tiny_llama[0], attention_provider="torch")
    taken: list[tuple[bool | None, bool]] = []  # (asked, taken) per split-K launch
    choose = balanced_plan.use_balanced

    def spy(balanced, chunk, auto, rows):
        got = choose(balanced, chunk, auto, rows)
        taken.append((balanced, got))
        return got

    monkeypatch.setattr(balanced_plan, "use_balanced", spy)
    assert _tokens(tiny_llama[0], attention_provider="triton") == want
    assert taken and all(asked is None for asked, _ in taken)
    assert any(got for _, got in taken)  # 3 requests x 2 KV heads: rows cut by their own lengths, balanced
    taken.clear()
    assert _tokens(tiny_llama[0], attention_provider="triton", decode_split_plan="per_row") == want
    assert taken and all(asked is False and not got for asked, got in taken)


def test_bad_split_plans_are_config_errors(tiny_llama):
    folder = str(tiny_llama[0])
    with pytest.raises(ConfigError, match=r"Invalid decode_split_plan='balanced'.*auto, per_row"):
        LLM(folder, decode_split_plan="balanced", **CPU)
    with pytest.raises(ConfigError, match=r"decode_split_plan='per_row'.*attention_provider='auto'.*'triton'"):
        LLM(folder, decode_split_plan="per_row", **CPU)  # auto is the torch reference on a CPU
    with pytest.raises(ConfigError, match=r"attention_provider='torch'"):
        make_provider("torch", torch.device("cpu"), "per_row")
    assert make_provider("triton", torch.device("cuda"), "per_row").split_plan == "per_row"  # needs no GPU
    with pytest.raises(ValueError, match="split_plan must be one of auto, per_row"):
        make_provider("triton", torch.device("cuda"), "fixed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels on CPU tensors: the interpreter, "
                    "which tests/conftest.py sets only on a machine without CUDA")
def test_each_engine_merges_with_its_own_counters(tiny_llama, monkeypatch):
    """Decode launches that merge their splits in the split kernel count arrivals in their
    engine's provider's counters, never in the device's shared buffer (two engines replaying
    on two streams of one GPU would share that), and still give the torch tokens."""
    from sparseengine.kernels import _common, paged_decode

    want = _tokens(tiny_llama[0], attention_provider="triton")

    def shared(*args):
        raise AssertionError("a decode launch used the device's shared counters")

    monkeypatch.setattr(_common, "zeroed_counters", shared)
    monkeypatch.setattr(paged_decode, "MERGE_IN_SPLIT_KERNEL", True)
    used: list[torch.Tensor] = []
    split_k = paged_decode.split_k_decode

    def spy(*args, **kw):
        used.append(kw.get("counters"))
        return split_k(*args, **kw)

    monkeypatch.setattr(paged_decode, "split_k_decode", spy)
    with LLM(str(tiny_llama[0]), attention_provider="triton", **CPU) as a, \
            LLM(str(tiny_llama[0]), attention_provider="triton", **CPU) as b:
        mine = a.provider.split_kw(torch.device("cpu"))["counters"]
        theirs = b.provider.split_kw(torch.device("cpu"))["counters"]
        assert mine is not theirs and mine is a.provider.split_kw(torch.device("cpu"))["counters"]
        assert [o.token_ids for o in a.generate(PROMPTS, GREEDY)] == want
        assert used and all(c is mine for c in used)
    assert int(mine.abs().sum()) == 0
