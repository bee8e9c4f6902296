"""flashprefill_v2: block-sparse causal prefill attention (the torch reference of the
block selection; the masked attention itself runs in the attention provider, which reads
the ``BlockMask`` this runtime returns from ``block_mask()``).

Definition (METHODS.md "flashprefill_v2", with the choices it leaves open fixed here). It
applies to each prefill attention call: one request's ``q_len`` query rows at cache
indices ``L - q_len .. L - 1`` against its ``L`` cached keys (during prefill a cache index
is the token position). Blocks of ``B = flashprefill_block`` tokens (block j = indices
``[jB, (j+1)B)``, aligned to position 0); query blocks ``i`` from ``(L - q_len) // B`` to
``(L - 1) // B``, key blocks ``j`` from 0 to ``ceil(L / B) - 1``.
1. Probe rows: the call's rows inside its last ``flashprefill_probe_blocks`` query blocks,
   i.e. rows at cache indices ``>= max(L - q_len, ((L - 1) // B - probe_blocks + 1) * B)``.
2. Estimated mass, per query head h and key block j: the probe rows' causal attention
   probabilities ``softmax(q k^T / sqrt(d))``, summed over the keys of block j and
   averaged over the probe rows (so the masses of a head sum to 1).
3. Query block i computes key block j iff ``j <= i`` and (``j < flashprefill_sink_blocks``,
   or ``j >= i - flashprefill_window_blocks`` (the last window blocks and the diagonal),
   or ``mass[h, j] >= flashprefill_threshold``). Inside the diagonal block the causal rule
   holds per token. One estimate serves every query block of the call (a vertical
   pattern per head); a threshold of 0 keeps every block (exactly dense attention).
4. Prompts shorter than ``flashprefill_min_len`` tokens, decode rows, and a cache that a
   decode method has already compacted run dense.
With chunked prefill (``all_chunked``) each chunk is one call: its probes are its own last
blocks; a prompt prefilled in one pass is exactly the whole-prompt definition, and then
``masks[b]`` is the ``[Hq, nb, nb]`` layout of ``kernels.block_sparse_prefill``.

``flashprefill_threshold`` is per model (``THRESHOLDS``); a model without an entry must
set it. Measurements: ``request_stats(request_id)`` / ``summary()`` give the fraction of
causal (query block, key block) pairs computed, summed over layers, heads and chunks, and,
with ``flashprefill_measure_error`` on (it runs dense attention beside the sparse one on
the same q/k/v, so it costs time), the relative L2 error of the attention output against
dense attention. Find the runtime as ``llm.method.parts[0]`` (the engine stacks the
prefill-side runtime in front of the decode one).
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from sparseengine.config import ConfigError
from sparseengine.engine.step_context import BlockMask
from sparseengine.method_registry import MethodSpec
from sparseengine.models.names import table_entry
from sparseengine.methods.base import SparseMethodRuntime

# flashprefill_threshold per model (estimated block mass, see the module docstring).
# SmolLM2-135M-Instruct, one-pass prefill of stdlib-docstring text, default blocks
# (threshold: fraction of causal blocks computed / relative L2 error of the attention output
# over all 30 layers): 4K tokens: 0 -> 1.0/0; 0.0005 -> .78/1.5%; 0.001 -> .72/2.0%;
# 0.002 -> .66/2.8%; 0.005 -> .57/4.0%; 0.01 -> .52/5.2%; 0.05 -> .41/7.6%; sink+window
# only -> .38/9.2%. 8K: 0.0005 -> .44/5.2%; 0.001 -> .38/6.3%; 0.002 -> .32/7.3%. At 0.002
# on 4K the next-token top-1 agrees with dense prefill at 98% of the last 2K positions.
# Models missing here (Llama-3.1-8B, Qwen3-8B: no weights here to measure with) must set it.
THRESHOLDS: dict[str, float] = {
    "smollm2-135m-instruct": 0.002,
}


# ----------------------------------------------------------------------- definitions


def probe_start(q_len: int, kv_len: int, block: int, probe_blocks: int) -> int:
    """Cache index of the first probe row of a call (rows ``L - q_len .. L - 1``)."""
    last_qb = (kv_len - 1) // block
    return max(kv_len - q_len, (last_qb - probe_blocks + 1) * block)


def block_mass(q_probe: torch.Tensor, k: torch.Tensor, block: int) -> torch.Tensor:
    """Estimated mass ``[Hq, ceil(L / block)]`` float32: the causal attention of the probe
    rows ``q_probe [R, Hq, d]`` (at cache indices ``L - R .. L - 1``) over ``k [L, Hkv, d]``,
    summed per key block and averaged over the rows. One KV head at a time (memory)."""
    r, hq, d = q_probe.shape
    length, hkv, _ = k.shape
    g = hq // hkv
    nkb = -(-length // block)
    rows = torch.arange(length - r, length, device=k.device)
    future = torch.arange(length, device=k.device)[None, :] > rows[:, None]  # [R, L]
    out = torch.empty(hq, nkb, dtype=torch.float32, device=k.device)
    for kh in range(hkv):
        qh = q_probe[:, kh * g:(kh + 1) * g].float().transpose(0, 1)  # [g, R, d]
        s = (qh @ k[:, kh].float().T) / math.sqrt(d)  # [g, R, L]
        p = torch.softmax(s.masked_fill(future, float("-inf")), dim=-1).mean(dim=1)  # [g, L]
        out[kh * g:(kh + 1) * g] = F.pad(p, (0, nkb * block - length)).view(g, nkb, block).sum(-1)
    return out


def fixed_blocks(first_qb: int, last_qb: int, nkb: int, sink_blocks: int, window_blocks: int,
                 device=None) -> torch.Tensor:
    """``[nq, nkb]`` bool: the blocks always computed (sink, window, diagonal), causal."""
    i = torch.arange(first_qb, last_qb + 1, device=device)[:, None]
    j = torch.arange(nkb, device=device)[None, :]
    return ((j < sink_blocks) | (j >= i - window_blocks)) & (j <= i)


def select_blocks(mass: torch.Tensor, first_qb: int, last_qb: int, sink_blocks: int,
                  window_blocks: int, threshold: float) -> torch.Tensor:
    """Block mask ``[Hq, nq, nkb]`` bool from the estimated ``mass [Hq, nkb]`` (step 3)."""
    hq, nkb = mass.shape
    fixed = fixed_blocks(first_qb, last_qb, nkb, sink_blocks, window_blocks, mass.device)
    causal = fixed_blocks(first_qb, last_qb, nkb, 0, nkb, mass.device)
    return fixed[None] | ((mass >= threshold)[:, None, :] & causal[None])


def flashprefill_mask(q: torch.Tensor, k: torch.Tensor, block: int, sink_blocks: int, window_blocks: int,
                      probe_blocks: int, threshold: float) -> torch.Tensor:
    """The block mask ``[Hq, nq, nkb]`` of one call: ``q [q_len, Hq, d]`` rows at cache
    indices ``L - q_len .. L - 1`` over ``k [L, Hkv, d]`` (steps 1-3). When sink and window
    already cover every causal block nothing is estimated."""
    q_len, hq, _ = q.shape
    length = k.shape[0]
    first_qb, last_qb, nkb = (length - q_len) // block, (length - 1) // block, -(-length // block)
    fixed = fixed_blocks(first_qb, last_qb, nkb, sink_blocks, window_blocks, q.device)
    causal = fixed_blocks(first_qb, last_qb, nkb, 0, nkb, q.device)
    if bool(fixed.eq(causal).all()):
        return fixed[None].expand(hq, -1, -1).clone()
    r = length - probe_start(q_len, length, block, probe_blocks)
    mass = block_mass(q[q_len - r:], k, block)
    return select_blocks(mass, first_qb, last_qb, sink_blocks, window_blocks, threshold)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     block: int) -> torch.Tensor:
    """Reference attention of one call (rows at ``L - q_len .. L - 1``) under a block mask
    (``None``: dense causal) -> ``[q_len, Hq, d]`` float32."""
    q_len, length = q.shape[0], k.shape[0]
    allowed = BlockMask(block, (mask,)).token_mask(0, q_len, length) if mask is not None else \
        (torch.arange(length, device=q.device)[None, :] <=
         torch.arange(length - q_len, length, device=q.device)[:, None])[None]
    o = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                       v.float().transpose(0, 1)[None], attn_mask=allowed[None], enable_gqa=True)
    return o[0].transpose(0, 1)


# --------------------------------------------------------------------------- runtime


def _knob_int(runtime, name: str, minimum: int) -> int:
    value = runtime.knob(name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"Invalid {name}={value!r}: must be an integer >= {minimum}")
    return int(value)


class FlashPrefillV2(SparseMethodRuntime):
    def __init__(self, config, model, cache) -> None:
        super().__init__(config, model, cache)
        self.block = _knob_int(self, "flashprefill_block", 16)
        if self.block & (self.block - 1):
            raise ConfigError(f"Invalid flashprefill_block={self.block}: must be a power of two >= 16 "
                              "(the block-sparse kernel's tile)")
        self.sink_blocks = _knob_int(self, "flashprefill_sink_blocks", 0)
        self.window_blocks = _knob_int(self, "flashprefill_window_blocks", 0)
        self.probe_blocks = _knob_int(self, "flashprefill_probe_blocks", 1)
        self.min_len = _knob_int(self, "flashprefill_min_len", 0)
        self.measure_error = bool(self.knob("flashprefill_measure_error"))
        threshold = self.knob("flashprefill_threshold")
        if threshold is None:
            threshold = table_entry(THRESHOLDS, model.name)
            if threshold is None:
                raise ConfigError(
                    f"Model {model.name!r} has no default flashprefill_threshold; set flashprefill_threshold "
                    f"(the estimated attention mass a key block needs, e.g. flashprefill_threshold=0.002). "
                    f"Known models: {', '.join(sorted(THRESHOLDS))}")
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not math.isfinite(threshold):
            raise ConfigError(f"Invalid flashprefill_threshold={threshold!r}: must be a finite number")
        self.threshold = float(threshold)
        self.stats: dict[int, dict] = {}  # request id -> counts (kept after the request ends)

    # ---- the block mask of each prefill call ----------------------------------------------
    def block_mask(self, layer, q, ctx):
        if ctx.is_decode and all(s is None or s.is_decoding for s in ctx.seqs):
            return None  # decode rows run dense; a CUDA-graph capture has no host requests
        masks, start = [], 0
        for seq, n in zip(ctx.seqs, ctx.q_lens):
            masks.append(None if seq.is_decoding else self._request_mask(seq, layer, q[start:start + n], n))
            start += n
        if all(m is None for m in masks):
            return None
        return BlockMask(self.block, tuple(masks))

    def _request_mask(self, seq, layer: int, q: torch.Tensor, n: int) -> torch.Tensor | None:
        held = seq.layer_lens[layer]
        length = held + n
        st = self.stats.setdefault(seq.seq_id, {"blocks_computed": 0, "blocks_total": 0, "sparse": False,
                                                "err_sq": 0.0, "ref_sq": 0.0, "max_rel_error": 0.0})
        first_qb, last_qb, nkb = (length - n) // self.block, (length - 1) // self.block, -(-length // self.block)
        total = int(fixed_blocks(first_qb, last_qb, nkb, 0, nkb).sum()) * q.shape[1]
        st["blocks_total"] += total
        if seq.num_prompt_tokens < self.min_len or held != seq.num_computed_tokens:
            st["blocks_computed"] += total
            return None
        st["sparse"] = True
        k, v = self.cache.gather(seq, layer, length)
        mask = flashprefill_mask(q, k, self.block, self.sink_blocks, self.window_blocks, self.probe_blocks,
                                 self.threshold)
        st["blocks_computed"] += int(mask.sum())
        if self.measure_error:
            dense = masked_attention(q, k, v, None, self.block)
            err = float((masked_attention(q, k, v, mask, self.block) - dense).pow(2).sum())
            ref = float(dense.pow(2).sum())
            st["err_sq"] += err
            st["ref_sq"] += ref
            st["max_rel_error"] = max(st["max_rel_error"], math.sqrt(err / ref) if ref > 0 else 0.0)
        return mask

    def release(self, seq) -> None:
        if not seq.is_finished:  # preempted: the prefill runs again from the start
            self.stats.pop(seq.seq_id, None)

    # ---- measurements ----------------------------------------------------------------------
    def _report(self, st: dict) -> dict:
        measured = self.measure_error and st["sparse"]
        return {
            "block_fraction": st["blocks_computed"] / st["blocks_total"] if st["blocks_total"] else 1.0,
            "blocks_computed": st["blocks_computed"], "blocks_total": st["blocks_total"],
            "sparse": st["sparse"],
            "attn_rel_error": (math.sqrt(st["err_sq"] / st["ref_sq"]) if st["ref_sq"] > 0 else 0.0)
            if measured else (0.0 if not st["sparse"] else None),
            "attn_max_rel_error": st["max_rel_error"] if measured else (0.0 if not st["sparse"] else None),
        }

    def request_stats(self, request_id: int) -> dict | None:
        """For one request (``RequestOutput.request_id``): ``block_fraction`` (causal block
        pairs computed / all, over layers, heads and chunks), ``sparse`` (False: it ran
        dense), ``attn_rel_error`` (relative L2 error of the attention output against dense
        on the same inputs, over layers and chunks) and ``attn_max_rel_error`` (the worst
        layer and chunk); the errors are None unless ``flashprefill_measure_error``."""
        st = self.stats.get(request_id)
        return None if st is None else self._report(st)

    def summary(self) -> dict:
        """The same over every request recorded so far."""
        keys = ("blocks_computed", "blocks_total", "err_sq", "ref_sq")
        total = {k: sum(s[k] for s in self.stats.values()) for k in keys}
        total["sparse"] = any(s["sparse"] for s in self.stats.values())
        total["max_rel_error"] = max([s["max_rel_error"] for s in self.stats.values()] or [0.0])
        return {**self._report(total), "requests": len(self.stats)}

    def clear_stats(self) -> None:
        self.stats.clear()


SPEC = MethodSpec(
    name="flashprefill_v2", kind="prefill", family="block_sparse_prefill", runtime=FlashPrefillV2,
    combines_with=("vanilla", "snapkv", "h2o", "omnikv", "quest"),
    knobs={"flashprefill_block": 128, "flashprefill_sink_blocks": 2, "flashprefill_window_blocks": 4,
           "flashprefill_probe_blocks": 8, "flashprefill_threshold": None, "flashprefill_min_len": 4096,
           "flashprefill_measure_error": False},
    paper="Fan et al., FlashPrefill: Instantaneous Pattern Discovery and Thresholding for Ultra-Fast "
          "Long-Context Prefilling, arXiv 2603.06199 (2026)")
