"""The torch reference provider: plain gathers and softmax over the paged cache.

It is the correctness oracle on CPU and GPU. Decode without selection or scores runs as
one batched masked SDPA call per layer; everything else runs request by request with
explicit float32 probabilities, so column sums come from the same softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparseengine.attention.provider import AttentionProvider, check_prefill_scores, padded_colsum_width
from sparseengine.engine.step_context import BlockMask, LayerView, ScoreRows, Selection, StepContext
from sparseengine.kernels.omnikv_scores import group_max_logits_torch


def token_slots(page_table_row: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """Cache slots of logical tokens 0..length-1 of one request."""
    pos = torch.arange(length, device=page_table_row.device)
    return page_table_row[pos // page_size].long() * page_size + pos % page_size


class TorchAttentionProvider(AttentionProvider):
    name = "torch"
    supports_cuda_graphs = False  # reads host lengths each step
    triton_kernels = False

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping):
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext,
               view: LayerView, selection: Selection | None, score_rows: ScoreRows | None,
               block_mask: BlockMask | None = None):
        if score_rows is not None and score_rows.kind == "max_logits":
            if not ctx.is_decode:
                check_prefill_scores(score_rows)
            bound = padded_colsum_width(score_rows, view)
            out, _ = self.attend(q, k_cache, v_cache, ctx, view, selection, None, block_mask)
            return out, group_max_logits_torch(q, k_cache, view.page_table, view.kv_lens, bound)
        if ctx.is_decode and selection is None and score_rows is None and block_mask is None:
            return self._decode_batched(q, k_cache, v_cache, view), None
        page_size = k_cache.shape[1]
        kc = k_cache.view(-1, *k_cache.shape[2:])
        vc = v_cache.view(-1, *v_cache.shape[2:])
        out = torch.empty_like(q)
        colsums: list[torch.Tensor] | None = [] if score_rows is not None else None
        start = 0
        for b, q_len in enumerate(ctx.q_lens):
            length = view.kv_lens_list[b]
            qb = q[start:start + q_len]
            rows = score_rows.rows[b] if score_rows is not None else 0
            selected = selection is not None and not selection.dense[b]
            blocked = block_mask is not None and block_mask.masks[b] is not None
            if selected and q_len == 1 and rows == 0 and not blocked:  # read only the selected tokens
                out[start] = self._selected_decode(qb[0], kc, vc, view.page_table[b], page_size,
                                                   *selection.request_tokens(b, length))
                if colsums is not None:
                    colsums.append(q.new_zeros(kc.shape[1], length, dtype=torch.float32))
                start += q_len
                continue
            slots = token_slots(view.page_table[b], length, page_size)
            k, v = kc[slots], vc[slots]
            allowed = None
            if selected:
                allowed = torch.zeros(k.shape[1], length, dtype=torch.bool, device=q.device)
                idx, valid = selection.request_tokens(b, length)
                heads = torch.arange(idx.shape[0], device=q.device)[:, None].expand_as(idx)
                allowed[heads[valid], idx[valid]] = True
            row_allowed = block_mask.token_mask(b, q_len, length) if blocked else None
            if allowed is None and rows == 0:
                out[start:start + q_len] = self._sdpa(qb, k, v, length, row_allowed)
                if colsums is not None:  # one entry per request, even when it asked for no rows
                    colsums.append(q.new_zeros(k.shape[1], length, dtype=torch.float32))
            else:
                o, p = self._explicit(qb, k, v, length, allowed, row_allowed)
                out[start:start + q_len] = o
                if colsums is not None:
                    g = qb.shape[1] // k.shape[1]
                    cs = p[:, q_len - rows:, :].sum(1) if rows else p.new_zeros(p.shape[0], length)
                    colsums.append(cs.view(k.shape[1], g, length).mean(1))
            start += q_len
        bound = None if score_rows is None or not ctx.is_decode else padded_colsum_width(score_rows, view)
        if bound:
            colsums = torch.stack([F.pad(c, (0, bound - c.shape[-1])) for c in colsums])
        return out, colsums

    @staticmethod
    def _selected_decode(q, kc, vc, table_row, page_size, idx, valid):
        """One decode query [Hq, d] over its selected tokens idx [Hkv, K] (where valid; the
        others hold 0, a readable slot)."""
        hkv = idx.shape[0]
        hq, d = q.shape
        slots = table_row[idx // page_size].long() * page_size + idx % page_size  # [Hkv, K]
        heads = torch.arange(hkv, device=q.device)[:, None]
        k, v = kc[slots, heads].float(), vc[slots, heads].float()  # [Hkv, K, d]
        s = torch.einsum("hgd,hkd->hgk", q.float().view(hkv, hq // hkv, d), k) * d ** -0.5
        p = torch.softmax(s.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
        return torch.einsum("hgk,hkd->hgd", p, v).reshape(hq, d).to(q.dtype)

    @staticmethod
    def _causal_mask(q_len: int, length: int, device) -> torch.Tensor:
        qpos = torch.arange(length - q_len, length, device=device)[:, None]
        return torch.arange(length, device=device)[None, :] <= qpos  # [q_len, length]

    def _sdpa(self, q, k, v, length, row_allowed=None):
        """``row_allowed [Hq, q_len, length]``: a per-row mask (block-sparse prefill) that
        already holds the causal rule; None: plain causal."""
        q_len = q.shape[0]
        mask = self._causal_mask(q_len, length, q.device)[None] if row_allowed is None else row_allowed
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask[None], enable_gqa=True)
        return o[0].transpose(0, 1)

    def _explicit(self, q, k, v, length, allowed, row_allowed=None):
        """-> out [q_len, Hq, d], probs [Hq, q_len, length] (float32). ``allowed [Hkv, length]``:
        a selection shared by the rows; ``row_allowed [Hq, q_len, length]``: a per-row mask."""
        q_len, hq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        # grouped batched matmuls: each KV head once for its g query heads (no repeated K/V)
        qg = q.float().permute(1, 0, 2).reshape(hkv, g, q_len, d)
        s = torch.matmul(qg, k.float().permute(1, 2, 0)[:, None]).mul_(d ** -0.5).view(hq, q_len, length)
        mask = self._causal_mask(q_len, length, q.device)[None]
        if allowed is not None:
            mask = mask & allowed.repeat_interleave(g, dim=0)[:, None, :]
        if row_allowed is not None:
            mask = mask & row_allowed
        s.masked_fill_(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = torch.matmul(p.view(hkv, g, q_len, length), v.float().permute(1, 0, 2)[:, None])  # [Hkv, g, q, d]
        return o.reshape(hq, q_len, d).permute(1, 0, 2).to(q.dtype), p

    @staticmethod
    def _decode_batched(q, k_cache, v_cache, view):
        page_size = k_cache.shape[1]
        max_len = max(view.kv_lens_list)
        pos = torch.arange(max_len, device=q.device)
        slots = view.page_table[:, pos // page_size].long() * page_size + pos % page_size  # [B, L]
        k = k_cache.view(-1, *k_cache.shape[2:])[slots]  # [B, L, Hkv, d]
        v = v_cache.view(-1, *v_cache.shape[2:])[slots]
        mask = pos[None, :] < view.kv_lens.to(pos.device)[:, None]  # [B, L]
        o = F.scaled_dot_product_attention(
            q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask[:, None, None, :], enable_gqa=True)
        return o[:, :, 0, :]
