"""A DeltaKV checkpoint for a model shape with dummy weights (the decode benchmarks' lane):
the calibration CLI fits Down/Up on that model's own KV for seeded random token ids, and
the engine decodes with it after a synthesised prefill."""

from __future__ import annotations

import pytest

from sparseengine import LLM, SamplingParams
from sparseengine.methods import deltakv_fit
from sparseengine.methods.deltakv_calibrate import main


def test_random_token_checkpoint_for_a_dummy_shape(tmp_path):
    def args(out):
        return ["--model", "tiny-llama", "--load-format", "dummy", "--random-tokens", "1500", "--seed", "3",
                "--out", str(out), "--latent-dim", "32", "--segment-tokens", "500", "--sink-tokens", "16",
                "--device", "cpu", "--dtype", "float32"]

    out = tmp_path / "tiny_dummy.safetensors"
    result = main(args(out))
    layers, meta = deltakv_fit.load_checkpoint(out)
    assert meta["model_name"] == "tiny-llama" and int(meta["tokens"]) == 1500 and int(meta["segments"]) == 3
    assert meta["sources"] == "random token ids (seed 3, vocab 512)"
    assert sorted(layers) == [0, 1, 2, 3] and all(d.shape == (64, 32) for d, _ in layers.values())
    again = main(args(tmp_path / "again.safetensors"))  # seeded: the same tokens, the same fit
    assert all((a[0] - b[0]).abs().max() == 0 for a, b in zip(result.layers.values(), again.layers.values()))

    with LLM("tiny-llama", load_format="dummy", dtype="float32", device="cpu", sparse_method="deltakv",
             deltakv_full_layers="1", deltakv_latent_dim=32, deltakv_checkpoint_path=str(out), sink_tokens=16,
             recent_tokens=32, budget=64, max_model_len=1024) as llm:
        prompts = [[(5 * i + j) % 500 + 3 for j in range(400)] for i in range(2)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                            prefill="synthesized")
        assert [len(o.token_ids) for o in outs] == [48, 48]
        stored = llm.method.bytes_at_end  # what each request kept, measured from its tensors
        assert len(stored) == 2 and all(b.ratio < 1 for b in stored.values()), stored


def test_random_tokens_must_be_positive(tmp_path):
    with pytest.raises(SystemExit):
        main(["--model", "tiny-llama", "--load-format", "dummy", "--random-tokens", "0",
              "--out", str(tmp_path / "x.safetensors")])
