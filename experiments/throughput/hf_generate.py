"""The external lane: Hugging Face transformers ``generate`` on the same model shape.

SDPA attention, dynamic cache, greedy. A logits processor stamps the time of every
generation step after synchronising the device, so decode tok/s comes from the stamps
after the first (which follows the prefill): prefill time does not leak into it. The
first ``warmup_steps`` decode steps are not timed (as the engine's decode window has its
warm-up). ``warmup_calls`` whole ``generate`` calls of the same shape run first, timed the
same way and recorded apart (``cold_*``): on the H200 at 128K the first call of a process
decoded at 16.2 tok/s (58 ms median step) and the next two at 43.8 and 44.5 (22.7 and 22.1
ms; ``python -m experiments.throughput.hf_generate --repeat 3``, commit 64f9700), so a
single call measures mostly a cold allocator (the dynamic cache grows by one token a step,
and its new tensors find no cached block to reuse), not generate's steady state; with 16
steps timed right after the prefill of a single call the lane read 6.7 to 16.1 tok/s
across jobs. The lane's ``output_tok_s`` is the last call's. Weights come from the
engine's model source: the folder when there is one, random (dummy) weights of the same
shape otherwise (decode speed does not depend on the values).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HFDecode:
    batch: int
    prompt_tokens: int
    timed_steps: int
    step_s: float  # mean over the timed steps (output_tok_s = batch / step_s)
    output_tok_s: float
    prefill_s: float
    warmup_steps: int = 0
    step_s_median: float = 0.0
    warmup_calls: int = 0
    cold_output_tok_s: float | None = None  # the first call's (when warmup_calls > 0)
    cold_step_s_median: float | None = None
    implementation: str = "transformers generate, sdpa, dynamic cache"


def _model(engine_kwargs: dict, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    from sparseengine.models import loader

    source = loader.resolve(str(engine_kwargs["model"]), str(engine_kwargs.get("load_format", "auto")))
    if source.folder is not None:
        return AutoModelForCausalLM.from_pretrained(str(source.folder), dtype=dtype).to(device).eval()
    hf = dict(source.hf_config)
    cfg = AutoConfig.for_model(hf.pop("model_type", "llama"), **hf)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def measure(engine_kwargs: dict, batch: int, prompt_tokens: int, new_tokens: int, device: torch.device,
            dtype: torch.dtype, seed: int = 0, warmup_steps: int = 0, warmup_calls: int = 0) -> HFDecode:
    """``new_tokens``: the prefill's token, then ``warmup_steps`` untimed decode steps, then
    the timed ones (at least one); all of it ``warmup_calls + 1`` times, the last call's
    steps the result and the first call's the ``cold_*`` fields."""
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    if warmup_steps < 0 or new_tokens < warmup_steps + 2:
        raise ValueError(f"new_tokens={new_tokens}, warmup_steps={warmup_steps}: new_tokens must be at least "
                         "warmup_steps + 2 (the prefill's token and one timed decode step)")
    if warmup_calls < 0:
        raise ValueError(f"warmup_calls must be >= 0, got {warmup_calls}")

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.times.append(time.perf_counter())
            return scores

    model = _model(engine_kwargs, device, dtype)
    try:
        model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, model.config.vocab_size, (batch, prompt_tokens), generator=gen).to(device)
        calls = []
        for _ in range(warmup_calls + 1):
            stamp = Stamp()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, logits_processor=LogitsProcessorList([stamp]))
            timed = stamp.times[warmup_steps:]
            each = sorted(b - a for a, b in zip(timed, timed[1:]))
            calls.append((stamp.times[0] - t0, len(timed) - 1, timed[-1] - timed[0], each[len(each) // 2]))
        prefill, steps, decode, median = calls[-1]
        cold = dict(cold_output_tok_s=batch * calls[0][1] / calls[0][2], cold_step_s_median=calls[0][3]) \
            if warmup_calls else {}
        return HFDecode(batch=batch, prompt_tokens=prompt_tokens, timed_steps=steps, step_s=decode / steps,
                        output_tok_s=batch * steps / decode, prefill_s=prefill, warmup_steps=warmup_steps,
                        step_s_median=median, warmup_calls=warmup_calls, **cold)
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None) -> None:
    """The HF lane alone, ``--repeat`` times in this process (each one JSON line), so its
    spread can be read apart from the engine's lanes: ``python -m
    experiments.throughput.hf_generate --out F`` (the 128K benchmark's shape by default)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--prompt-tokens", type=int, default=131072)
    parser.add_argument("--new-tokens", type=int, default=73)
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", required=True, help="JSON-lines file to append results to")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kwargs = {"model": args.model, "load_format": args.load_format}
    for i in range(args.repeat):
        r = measure(kwargs, 1, args.prompt_tokens, args.new_tokens, device, torch.bfloat16,
                    warmup_steps=args.warmup_steps)  # one call each: the spread between calls
        record = {"kind": "hf_lane_alone", "commit": args.commit, "run_in_process": i,
                  "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", **vars(r)}
        print(json.dumps(record))
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
