"""Fit DeltaKV's Down/Up per layer on the model's own KV and write the checkpoint.

    python -m sparseengine.methods.deltakv_calibrate --model smollm2-135m-instruct \\
        --text README.md --out deltakv_smollm2.safetensors [--latent-dim 256] [--max-tokens 8192]

The text is tokenized, cut into segments of ``--segment-tokens``, and each segment is
prefilled by the engine itself (``LLM(...)``, ``sparse_method=vanilla``); its KV is read
back from the paged cache through the cache manager. Per layer, keys are un-rotated to
pre-RoPE, concatenated with values (``K|V``), the first ``--sink-tokens`` are dropped
(the runtime keeps them raw; its codec positions start after them, so the residuals seen
here are exactly those the runtime encodes), and the residuals against the nearest
earlier centers (``deltakv_codec.residuals``) are summed into a float64 Gram matrix.
``Down``/``Up`` are its top ``--latent-dim`` eigenvectors (PCA, the least-squares optimal
linear pair; ``deltakv_fit.fit_down_up_from_gram``). Every layer is fitted, so one
checkpoint serves any ``deltakv_full_layers``. Metadata: model, latent dim, center ratio,
neighbours (checked by the runtime), and sink tokens, tokens, segments, sources and the
per-layer fraction of residual energy kept (informational).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sparseengine.methods import deltakv_codec as codec
from sparseengine.methods import deltakv_fit


@dataclass
class CalibrationResult:
    path: Path | None
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]]
    meta: dict
    tokens: int  # tokens prefilled
    residual_rows: int  # residual rows per layer
    energy_kept: list[float]  # per layer: top-r eigenvalues / trace of the residual Gram
    seconds: float


def prefill_kv(llm, token_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill ``token_ids`` with the engine and read every layer's cached K (rotated, as
    stored) and V ``[n, Hkv, d]`` back through the cache manager; the request is then
    finished and its pages returned."""
    from sparseengine.engine.sequence import Sequence
    from sparseengine.sampling_params import SamplingParams

    # max_tokens=2: the prefill step samples one token and the request stays alive.
    seq = Sequence(list(token_ids), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                   llm.model_config.num_layers)
    error = llm.scheduler.validate(seq, llm.method.cache_tokens_needed(seq.num_prompt_tokens))
    if error is not None:
        raise ValueError(error)
    llm.scheduler.add(seq)
    try:
        while seq.num_computed_tokens < seq.num_prompt_tokens and not seq.is_finished:
            llm.step()
        if seq.is_finished:
            raise RuntimeError(f"calibration prefill ended early: {seq.finish_reason} {seq.error or ''}")
        return [llm.cache.gather(seq, layer) for layer in range(llm.model_config.num_layers)]
    finally:
        if not seq.is_finished:
            llm.scheduler.finish(seq, "length")
        llm.method.release(seq)
        llm.cache.drop(seq)
        llm.sampler.release(seq.seq_id)


def layer_kv(k: torch.Tensor, v: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE ``K|V [n, D]`` of a cached segment whose token i sits at position i."""
    positions = torch.arange(k.shape[0], device=k.device)
    return codec.concat_kv(codec.unrotate_keys(k, positions, inv_freq).to(k.dtype), v)


def calibrate(model: str, *, text: str | None = None, token_ids: list[int] | None = None,
              out: str | Path | None = None, latent_dim: int = 256, center_ratio: float = 0.1,
              neighbors: int = 4, sink_tokens: int = 64, max_tokens: int | None = 8192,
              segment_tokens: int = 2048, progress: bool = True, sources: str = "",
              **llm_kwargs) -> CalibrationResult:
    """Calibrate on ``text`` (tokenized by the model's tokenizer) or ``token_ids``; write
    the checkpoint to ``out`` when given. ``llm_kwargs`` go to ``LLM(...)``."""
    from sparseengine import LLM
    from sparseengine.layers.rotary import rope_inv_freq

    t0 = time.perf_counter()
    stride = codec.center_stride(center_ratio)
    if segment_tokens <= sink_tokens + 2 * stride:
        raise ValueError(f"segment_tokens={segment_tokens} leaves no history after sink_tokens={sink_tokens}")
    page_size = llm_kwargs.get("page_size", 16)
    llm_kwargs.setdefault("num_kv_pages", -(-(segment_tokens + 2) // page_size) + 1)
    with LLM(model, sparse_method="vanilla", **llm_kwargs) as llm:
        mc = llm.model_config
        dim = 2 * mc.num_kv_heads * mc.head_dim
        if latent_dim > dim:
            raise ValueError(f"latent_dim={latent_dim} exceeds the K|V dim 2*Hkv*d={dim} of {mc.name}")
        if token_ids is None:
            if text is None:
                raise ValueError("give text or token_ids")
            if llm.tokenizer is None:
                raise ValueError(f"model {mc.name!r} has no tokenizer: pass token_ids")
            token_ids = llm.tokenizer.encode(text, add_special_tokens=False)
        token_ids = list(token_ids)[: max_tokens or None]
        segment_tokens = min(segment_tokens, llm.max_model_len - 2)
        segments = [token_ids[i:i + segment_tokens] for i in range(0, len(token_ids), segment_tokens)]
        segments = [s for s in segments if len(s) > sink_tokens + 2 * stride]
        if not segments:
            raise ValueError(f"{len(token_ids)} tokens: too few to calibrate (need more than "
                             f"sink_tokens + 2 * center stride = {sink_tokens + 2 * stride})")
        inv_freq = rope_inv_freq(mc.head_dim, mc.rope_theta, mc.rope_scaling).float().to(llm.device)
        grams = [torch.zeros(dim, dim, dtype=torch.float64, device=llm.device) for _ in range(mc.num_layers)]
        rows = 0
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=sum(map(len, segments)), unit="tok", desc=f"deltakv calibrate {mc.name}")
        for seg in segments:
            for layer, (k, v) in enumerate(prefill_kv(llm, seg)):
                kv = layer_kv(k, v, inv_freq)[sink_tokens:]
                res, _ = codec.residuals(kv, center_ratio, neighbors)
                grams[layer] += deltakv_fit.residual_gram(res)
            rows += res.shape[0]
            if bar is not None:
                bar.update(len(seg))
        if bar is not None:
            bar.close()
        layers, kept = {}, []
        for layer, gram in enumerate(grams):
            layers[layer] = deltakv_fit.fit_down_up_from_gram(gram, latent_dim)
            eig = torch.linalg.eigvalsh((gram + gram.T) / 2).clamp(min=0)
            kept.append(float(eig[-latent_dim:].sum() / eig.sum().clamp(min=1e-300)))
        meta = {"model_name": mc.name, "latent_dim": latent_dim, "center_ratio": center_ratio,
                "neighbors": neighbors, "sink_tokens": sink_tokens, "segment_tokens": segment_tokens,
                "tokens": sum(map(len, segments)), "segments": len(segments), "residual_rows": rows,
                "sources": sources, "energy_kept": json.dumps([round(x, 6) for x in kept])}
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        deltakv_fit.save_checkpoint(out, layers, meta)
    return CalibrationResult(out, layers, meta, meta["tokens"], rows, kept, time.perf_counter() - t0)


def random_tokens(model: str, load_format: str, n: int, seed: int = 0) -> dict:
    """``calibrate``'s source for a model whose KV no text makes more real (dummy weights):
    ``n`` seeded random token ids over its vocabulary (ids from 3, past the usual specials)."""
    from sparseengine.models.loader import resolve

    vocab = resolve(model, load_format).model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    return dict(token_ids=torch.randint(3, vocab, (n,), generator=gen).tolist(),
                sources=f"random token ids (seed {seed}, vocab {vocab})")


def main(argv: list[str] | None = None) -> CalibrationResult:
    ap = argparse.ArgumentParser(description="Fit DeltaKV Down/Up on a model's own KV and write the checkpoint "
                                             "(deltakv_checkpoint_path).")
    ap.add_argument("--model", required=True, help="engine model name or HF folder (as LLM(model=...))")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", nargs="+", help="text file(s), concatenated")
    src.add_argument("--random-tokens", type=int, metavar="N",
                     help="N seeded random token ids instead of text: for a model shape with dummy weights "
                          "(--load-format dummy, the decode benchmarks), whose KV no text makes more real")
    ap.add_argument("--seed", type=int, default=0, help="seed of --random-tokens")
    ap.add_argument("--load-format", default="auto", help="as LLM(load_format=...): dummy for random weights")
    ap.add_argument("--out", required=True, help="checkpoint path (.safetensors)")
    ap.add_argument("--latent-dim", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=8192,
                    help="tokens of text used (0: all); 8192 keeps SmolLM2 under 10 min on 2 busy CPU cores")
    ap.add_argument("--center-ratio", type=float, default=0.1)
    ap.add_argument("--neighbors", type=int, default=4)
    ap.add_argument("--sink-tokens", type=int, default=64, help="leading tokens per segment left out (kept raw)")
    ap.add_argument("--segment-tokens", type=int, default=2048, help="tokens per prefill")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    if args.text:
        source = dict(text="\n\n".join(Path(p).read_text(encoding="utf-8") for p in args.text),
                      sources=",".join(Path(p).name for p in args.text))
    else:
        if args.random_tokens < 1:
            ap.error(f"--random-tokens must be positive, got {args.random_tokens}")
        source = random_tokens(args.model, args.load_format, args.random_tokens, args.seed)
    result = calibrate(args.model, out=args.out, latent_dim=args.latent_dim, center_ratio=args.center_ratio,
                       neighbors=args.neighbors, sink_tokens=args.sink_tokens, max_tokens=args.max_tokens or None,
                       segment_tokens=args.segment_tokens, device=args.device, dtype=args.dtype,
                       load_format=args.load_format, **source)
    kept = result.energy_kept
    print(f"wrote {result.path}: {result.tokens} tokens in {result.meta['segments']} segments, "
          f"{len(result.layers)} layers, latent_dim={args.latent_dim}, residual energy kept "
          f"min {min(kept):.4f} mean {sum(kept) / len(kept):.4f}, {result.seconds:.1f} s")
    return result


if __name__ == "__main__":
    main()
