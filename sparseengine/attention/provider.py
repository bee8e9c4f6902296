"""The provider interface and the choice by capability (recorded, never silent)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparseengine.config import ConfigError
from sparseengine.kernels.fused_ops import rotary_qk

if TYPE_CHECKING:
    from sparseengine.engine.step_context import BlockMask, LayerView, ScoreRows, Selection, StepContext


# The attention ops a provider runs; ``ops()`` says which implementation runs each.
OPS = ("write_kv", "decode", "prefill", "sparse_decode", "decode_colsum", "decode_max_logits",
       "prefill_colsum", "block_sparse_prefill")


class AttentionProvider:
    name = "base"
    # Decode steps may be captured in CUDA graphs: the provider reads lengths from device
    # tensors only (a graph's views carry placeholder host lengths), or from the plans it
    # makes in ``plan_graph_step``.
    supports_cuda_graphs = True
    # Method-side helper kernels (Quest page bounds, OmniKV scores) run as Triton kernels
    # beside this provider; False: their vectorised torch versions.
    triton_kernels = True

    def ops(self) -> dict[str, str]:
        """Which implementation runs each op (benchmarks write it into their records)."""
        return {op: self.name for op in OPS}

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        raise NotImplementedError

    def rotate_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> torch.Tensor:
        """Rotate q and k (rotary embedding, `fused_ops.rotary_qk`), write k and v at
        `slot_mapping` (`write_kv`); return q rotated. A provider may fuse the two."""
        q, k = rotary_qk(q, k, cos, sin)
        self.write_kv(k_cache, v_cache, k, v, slot_mapping)
        return q

    def plan_graph_step(self, graph, lens, table: torch.Tensor, k_cache: torch.Tensor, num_qo_heads: int):
        """The decode graphs call this before each capture and replay of graph ``graph`` (an
        id; the capture's ``StepContext.graph``), outside the graph, with the step's host
        lengths ``lens`` ``[L, B]`` (numpy; padding rows 1), the graph's device page table
        ``[B, W]`` and a layer's K cache ``[pages, page_size, Hkv, d]`` (its shape and dtype
        are every layer's): a provider whose kernels read plans made from host lengths makes them
        here. -> a key of what the capture bound (which plan each layer reads); when it
        changes, the graph is captured again. Default: no plans (None)."""
        return None

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: "StepContext",
               view: "LayerView", selection: "Selection | None",
               score_rows: "ScoreRows | None", block_mask: "BlockMask | None" = None,
               ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """-> (out [T, Hq, d], the scores ``score_rows`` asks for (``ScoreRows``: per request
        [Hkv, kv_len] column sums, one padded tensor when ``score_rows.max_kv_len`` is set;
        or max logits), or None). ``block_mask`` (passed only when a method
        asks for one): block-sparse causal prefill rows."""
        raise NotImplementedError


def padded_colsum_width(score_rows: "ScoreRows", view: "LayerView") -> int | None:
    """``score_rows.max_kv_len`` (the decode column sums come back as one padded tensor that
    wide), checked against the rows' lengths where the host knows them; None: one tensor
    per request. A CUDA graph's views carry placeholder host lengths of 1."""
    bound = score_rows.max_kv_len
    if bound is not None and max(view.kv_lens_list) > bound:
        raise ValueError(f"ScoreRows.max_kv_len={bound} is below a row's cache length {max(view.kv_lens_list)}")
    return bound


def check_prefill_scores(score_rows: "ScoreRows | None") -> None:
    """Steps with prefill rows report column sums only: max logits are a decode score."""
    if score_rows is not None and score_rows.kind != "colsum":
        raise ValueError(f"ScoreRows(kind={score_rows.kind!r}) is a decode-step score; a step with prefill rows "
                         "reports column sums only (kind='colsum')")


def make_provider(name: str, device: torch.device, split_plan: str = "auto") -> AttentionProvider:
    """``auto``: Triton on CUDA, the torch reference on CPU (never FlashInfer: it is an
    optional package and only an explicit choice). An explicit choice that the device or
    the installed packages cannot run is an error, never a silent fallback. ``split_plan``
    (``Config.decode_split_plan``) goes to the Triton split-K decode (FlashInfer's provider
    passes it to the Triton ops it runs); the torch provider has no split plan, so any
    choice but ``auto`` there is an error."""
    import os

    from sparseengine.attention.torch_ref import TorchAttentionProvider

    if name in ("auto", "torch") and (name == "torch" or device.type == "cpu"):
        if split_plan != "auto":
            raise ConfigError(f"decode_split_plan={split_plan!r} chooses the Triton split-K decode's plan, but "
                              f"attention_provider={name!r} runs the torch reference here (no split plan); use "
                              "attention_provider='triton' (on CPU under TRITON_INTERPRET=1) or "
                              "decode_split_plan='auto'")
        return TorchAttentionProvider()
    if name == "auto":
        name = "triton"
    if name == "flashinfer":  # checks the device and the package itself, naming the fix
        from sparseengine.attention.flashinfer_provider import FlashInferAttentionProvider
        return FlashInferAttentionProvider(device, split_plan=split_plan)
    interpreted = name == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        raise ConfigError(f"attention_provider={name!r} needs a CUDA device (Triton also runs on CPU under "
                          "TRITON_INTERPRET=1); on CPU use 'torch' or 'auto'")
    if name == "triton":
        from sparseengine.attention.triton_provider import TritonAttentionProvider
        return TritonAttentionProvider(split_plan)
    raise ConfigError(f"Unknown attention_provider={name!r}; valid: auto, torch, triton, flashinfer")
