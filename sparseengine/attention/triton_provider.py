"""The Triton provider: paged KV write, split-K decode, sparse decode over selections,
decode with column sums, chunked prefill over the paged cache, and SnapKV window column
sums. CUDA in production; under ``TRITON_INTERPRET=1`` the same kernels run on a CPU. On an
sm_90 GPU the attention over Quest's pages and OmniKV's pool rows is one CUDA launch
(``kernels.sparse_attention_cuda``, where its ``takes`` says so)."""

from __future__ import annotations

import torch

from sparseengine import kernels
from sparseengine.attention.provider import AttentionProvider, check_prefill_scores, padded_colsum_width
from sparseengine.engine.step_context import LayerView, ScoreRows, Selection, StepContext
from sparseengine.kernels import fused_ops, sparse_attention_cuda
from sparseengine.kernels._common import ArrivalCounters
from sparseengine.kernels.paged_decode import MAX_SPLIT_COUNTERS

# decode_split_plan -> split_k_decode's `balanced` (None: its auto choice)
SPLIT_PLANS = {"auto": None, "per_row": False}
# a mixed step's one-row requests run the split-K decode, not the chunked prefill (A/B knob)
ROUTE_DECODE_ROWS = True


def sparse_decode_impl() -> str:
    """What runs the sparse decode, for the records: "triton", or the CUDA attention where it
    takes the step's shapes (on the current CUDA device: sm_90 with nvcc)."""
    from sparseengine.kernels.nvcc_build import unavailable

    if sparse_attention_cuda.ENGINE and torch.cuda.is_available() and unavailable("cuda") is None:
        return ("cuda where it takes the selection (bf16, head dim 128, up to 8 query heads a KV head, pages of 16), "
                "else triton")
    return "triton"


class TritonAttentionProvider(AttentionProvider):
    name = "triton"

    def __init__(self, split_plan: str = "auto") -> None:
        """``split_plan`` (``Config.decode_split_plan``): ``auto``, the split-K decode's own
        plan (balanced across the batch where it cuts rows by their own lengths), or
        ``per_row`` (never balanced), for every decode op this provider runs."""
        if split_plan not in SPLIT_PLANS:
            raise ValueError(f"split_plan must be one of {', '.join(SPLIT_PLANS)}, got {split_plan!r}")
        self.split_plan = split_plan
        self._counters = ArrivalCounters(MAX_SPLIT_COUNTERS)

    def split_kw(self, device: torch.device) -> dict:
        """`split_k_decode`'s keywords for this provider's decode ops: the split plan, and
        this provider's own arrival counters on `device` (`ArrivalCounters`)."""
        return {"balanced": SPLIT_PLANS[self.split_plan], "counters": self._counters.on(device)}

    def ops(self) -> dict[str, str]:
        """Every op Triton's, but the sparse decode: on an sm_90 GPU with nvcc (and
        `sparse_attention_cuda.ENGINE` on) the CUDA attention takes the selections whose shapes
        it takes."""
        return {**super().ops(), "sparse_decode": sparse_decode_impl()}

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping):
        kernels.paged_kv_write_triton(k, v, k_cache, v_cache, slot_mapping)

    def rotate_write_kv(self, q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
        """One launch where the rotation runs as a Triton kernel (CUDA); else the two steps."""
        if fused_ops.runs_as_kernel("rotary_qk", q):
            return fused_ops.rotary_kv_write_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        return super().rotate_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext,
               view: LayerView, selection: Selection | None, score_rows: ScoreRows | None, block_mask=None):
        if block_mask is not None:  # flashprefill_v2's prefill rows; decode rows' selections come back here
            return kernels.block_sparse_paged_prefill.block_sparse_paged_attend(
                q, k_cache, v_cache, ctx, view, selection, score_rows, block_mask, self.attend, ROUTE_DECODE_ROWS)
        table, lens = view.page_table, view.kv_lens
        max_len = max(view.kv_lens_list)
        if ctx.is_decode:
            split = self.split_kw(q.device)
            if score_rows is not None and score_rows.kind == "max_logits":
                out, colsums = kernels.decode_max_logits_triton(q, k_cache, v_cache, table, lens,
                                                                padded_colsum_width(score_rows, view), **split,
                                                                fill=False)  # past a row: unread
            elif score_rows is not None:
                bound = padded_colsum_width(score_rows, view)
                out, colsum = kernels.decode_colsum_triton(q, k_cache, v_cache, table, lens,
                                                           max_kv_len=bound or max_len, **split)
                colsums = colsum if bound else [colsum[b, :, :n] for b, n in enumerate(view.kv_lens_list)]
            else:
                out, colsums = None, None
            return self._decode_rows(q, k_cache, v_cache, ctx, view, selection, out), colsums
        check_prefill_scores(score_rows)
        out = self._prefill_rows(q, k_cache, v_cache, ctx, view, selection)
        colsums = None
        if score_rows is not None:
            colsums = []
            for window in sorted(set(score_rows.rows)):
                if window == 0:
                    continue
                cs = kernels.prefill_window_colsum_triton(q, k_cache, table, lens, ctx.cu_q_lens, window,
                                                          max_kv_len=max_len)
                colsums.append((window, cs))
            colsums = [self._pick(colsums, w, b, n, k_cache.shape[2])
                       for b, (w, n) in enumerate(zip(score_rows.rows, view.kv_lens_list))]
        return out, colsums

    def _decode_rows(self, q, k_cache, v_cache, step: StepContext, view: LayerView, selection: Selection | None,
                     dense=None):
        """One query row a request ``q [B, Hq, d]`` of ``step``: the split-K decode over each
        request's whole cache, or over its selection where it has one. ``dense``: the
        whole-cache output if a kernel that emitted scores computed it already."""
        table, lens = view.page_table, view.kv_lens
        split = self.split_kw(q.device)
        if selection is None:
            return dense if dense is not None else kernels.paged_decode_triton(q, k_cache, v_cache, table, lens,
                                                                               **split)
        if not any(selection.dense):  # no host tensor: CUDA-graph capturable
            return self._sparse_decode(q, k_cache, v_cache, table, lens, selection)
        if all(selection.dense):
            return dense if dense is not None else kernels.paged_decode_triton(q, k_cache, v_cache, table, lens,
                                                                               **split)
        # some rows read their whole cache, the others only their selection: each kernel
        # reads its own rows (eager steps only: a graph's selections mark no row dense); one
        # row a request, so a group's rows are its requests; its cut view is made once a step
        w = step.group(b for b, d in enumerate(selection.dense) if d)
        p = step.group(b for b, d in enumerate(selection.dense) if not d)
        wv, pv = w.view(view), p.view(view)
        out = torch.empty_like(q)
        w.put_rows(out, w.rows_of(dense) if dense is not None else kernels.paged_decode_triton(
            w.rows_of(q), k_cache, v_cache, wv.page_table, wv.kv_lens, **split))
        p.put_rows(out, self._sparse_decode(p.rows_of(q), k_cache, v_cache, pv.page_table, pv.kv_lens,
                                            selection.take(p.requests, p.reqs)))
        return out

    def _prefill_rows(self, q, k_cache, v_cache, ctx: StepContext, view: LayerView, selection: Selection | None):
        """A step with prefill rows. With ``ROUTE_DECODE_ROWS`` the requests that bring one
        query row (a mixed step's decode rows) go to the split-K decode and the others to
        the chunked prefill, which skips them; without it the prefill computes every row
        and the decode rows that have a selection are computed again over it."""
        table, lens, q_lens = view.page_table, view.kv_lens, ctx.q_lens
        one = [b for b, n in enumerate(q_lens) if n == 1]
        route = ROUTE_DECODE_ROWS and bool(one) and len(one) < len(q_lens)
        many = [n for n in q_lens if n > 1] if route else q_lens
        out = kernels.paged_prefill_triton(q, k_cache, v_cache, table, lens, ctx.cu_q_lens, max_q_len=max(q_lens),
                                           min_q_len=min(many), skip_one_row=route)
        if route:
            rows = ctx.group(one)  # index tensors made once a step
            sub = selection.take(one, rows.reqs) if selection is not None else None
            rows.put_rows(out, self._decode_rows(rows.rows_of(q), k_cache, v_cache, rows.step, rows.view(view), sub))
        elif selection is not None:  # decode rows of a mixed batch read only their selection
            rows = [int(c) for c in ctx.cu_q_lens[1:].tolist()]
            last = torch.tensor([r - 1 for r in rows], device=q.device)
            sparse = self._sparse_decode(q[last], k_cache, v_cache, table, lens, selection)
            use = torch.tensor([not d and n == 1 for d, n in zip(selection.dense, q_lens)], device=q.device)
            out[last] = torch.where(use[:, None, None], sparse, out[last])
        return out

    def _sparse_decode(self, q, k_cache, v_cache, table, lens, selection: Selection) -> torch.Tensor:
        """Decode rows ``q [B, Hq, d]`` over their selected tokens or pages."""
        split = self.split_kw(q.device)
        cuda = sparse_attention_cuda  # one launch on an sm_90 GPU where it takes the shapes (its `takes`)
        if not selection.page_size:
            if selection.pool_rows is not None:  # no page-table load a token
                if cuda.takes(q, k_cache, selection.pool_rows.shape[2], pages=False):
                    return cuda.sparse_rows_decode_cuda(q, k_cache, v_cache, selection.pool_rows,
                                                        selection.num_selected)
                return kernels.sparse_rows_decode_triton(q, k_cache, v_cache, table, lens, selection.pool_rows,
                                                         selection.num_selected, **split)
            return kernels.sparse_decode_triton(q, k_cache, v_cache, table, lens, selection.token_indices,
                                                selection.num_selected, **split)
        if selection.page_size != k_cache.shape[1]:
            raise ValueError(f"a page selection of page_size={selection.page_size} needs a KV cache of that "
                             f"page size, got {k_cache.shape[1]}")
        if cuda.takes(q, k_cache, selection.token_indices.shape[2], pages=True):
            return cuda.sparse_page_decode_cuda(q, k_cache, v_cache, table, lens, selection.token_indices,
                                                selection.num_selected)
        return kernels.sparse_page_decode_triton(q, k_cache, v_cache, table, lens, selection.token_indices,
                                                 selection.num_selected, **split)

    @staticmethod
    def _pick(by_window, window, b, length, hkv):
        for w, cs in by_window:
            if w == window:
                return cs[b, :, :length]
        return torch.zeros(hkv, length, device=by_window[0][1].device if by_window else "cpu")
