"""How many bytes the KV pool may take: on a GPU what ``gpu_memory_utilization`` leaves
after the weights, the largest prefill step's activations (measured by running that step
once over a throwaway cache) and the decode graphs' logits; on a CPU ``kv_cache_memory``
GiB. ``pool_plan`` then cuts the bytes into pages."""

from __future__ import annotations

import torch

from sparseengine.attention.provider import make_provider
from sparseengine.engine.kv_cache import KVCache


def pool_budget(model, config, model_config, dtype: torch.dtype, device: torch.device, max_model_len: int) -> float:
    """Bytes for the pool (module docstring). ``model``: the loaded model, already on
    ``device``."""
    if device.type == "cuda":
        peak = warmup_peak_bytes(model, config, model_config, dtype, device, max_model_len)
        free, total = torch.cuda.mem_get_info(device)
        logits = config.max_num_seqs * model_config.vocab_size * 4 * 2  # graph pools hold them
        return total * config.gpu_memory_utilization - (total - free) - peak - logits
    return config.kv_cache_memory * (1 << 30)


@torch.inference_mode()
def warmup_peak_bytes(model, config, model_config, dtype: torch.dtype, device: torch.device,
                      max_model_len: int) -> int:
    """Run the largest prefill step once over a throwaway KV cache and measure the
    activation memory it needs on top of the weights (with a 10% and 256 MiB margin)."""
    from sparseengine.engine.step_context import LayerView, StepContext, set_step_context
    from sparseengine.methods.base import SparseMethodRuntime

    cfg, mc = config, model_config
    tokens = min(cfg.max_num_batched_tokens, max_model_len)
    pages = -(-tokens // cfg.page_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    kv = KVCache(mc, pages, cfg.page_size, dtype, device)
    base = torch.cuda.memory_allocated(device)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    pos = torch.arange(tokens, device=device)
    table = torch.arange(pages, dtype=torch.int32, device=device)[None]
    lens = torch.tensor([tokens], dtype=torch.int32, device=device)
    view = LayerView(pos.clone(), lens, (tokens,), table)
    ctx = StepContext(seqs=[None], q_lens=(tokens,), cu_q_lens=torch.tensor([0, tokens], dtype=torch.int32,
                      device=device), is_decode=False, views=[view] * mc.num_layers, kv_cache=kv,
                      provider=make_provider(cfg.attention_provider, device, cfg.decode_split_plan),
                      method=SparseMethodRuntime(cfg, mc, None), positions=pos)
    set_step_context(ctx)
    try:
        model.compute_logits(model(ids, pos)[-1:])
    finally:
        set_step_context(None)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del kv, ctx, view
    torch.cuda.empty_cache()
    return int(peak * 1.1) + (256 << 20)
