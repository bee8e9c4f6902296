"""The FlashInfer provider: dense paged decode and dense paged (chunked, mixed-batch)
prefill through FlashInfer's paged-KV wrappers; every other op is the Triton provider's.

Written against flashinfer-python==0.7.2.post1 (its decode.py / prefill.py, read from the
wheel): ``BatchDecodeWithPagedKVCacheWrapper(float_workspace, "NHD", use_tensor_cores=...,
backend="fa2")``, ``.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
head_dim, page_size, *, pos_encoding_mode, q_data_type, kv_data_type)``, ``.run(q,
(k_cache, v_cache))``; ``BatchPrefillWithPagedKVCacheWrapper(float_workspace, "NHD",
backend="fa2")``, ``.plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads,
num_kv_heads, head_dim_qk, page_size, *, causal, pos_encoding_mode, q_data_type,
kv_data_type)``, ``.run(q, (k_cache, v_cache))``. FlashInfer's causal mask is aligned to
the end of the cache (row i of a q_len-row chunk sees the first kv_len - q_len + i + 1
tokens), which is our chunked-prefill rule.

A mixed step's one-row requests (decode rows beside prefill chunks) are left out of
FlashInfer's prefill: those that read their whole cache go to FlashInfer's paged decode,
those that read a selection only to it, through the Triton sparse decode; each part is
planned over its own requests, their rows of q gathered (``triton_provider.ROUTE_DECODE_ROWS``
off: every row in the prefill, the rows with a selection computed again over it).

Eager steps plan on the host once per step and per distinct ``LayerView`` (layers that
share a view share the plan). The engine's decode CUDA graphs (whose views carry placeholder
host lengths) read graph wrappers planned before each capture and replay, from the step's
host lengths (``plan_graph_step``, ``flashinfer_graph_plans``); a capture outside them
raises. FlashInfer runs float16/bfloat16 only. ``backend="fa2"`` pins FlashInfer's kernels
(no auto routing to cuDNN, FA3 or trtllm-gen) and keeps the JIT build to two modules per
(dtype, head_dim): the CUDA-core decode kernel, and the FA2 paged prefill kernel, which
tensor-core decode also uses.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from sparseengine import kernels
from sparseengine.attention import triton_provider
from sparseengine.attention.flashinfer_graph_plans import FlashInferGraphPlans, page_csr
from sparseengine.attention.provider import OPS, AttentionProvider, check_prefill_scores
from sparseengine.attention.triton_provider import TritonAttentionProvider
from sparseengine.config import ConfigError
from sparseengine.engine.step_context import LayerView, RequestGroup, ScoreRows, Selection, StepContext

FLASHINFER_VERSION = "0.7.2.post1"  # the version this file was written and checked against
PIP_INSTALL = f"pip install flashinfer-python=={FLASHINFER_VERSION}"
WORKSPACE_BYTES = 256 << 20  # float scratch of the split-KV kernels, shared by all wrappers
FLASHINFER_OPS = ("decode", "prefill")  # the rest are the Triton provider's


def import_flashinfer():
    """The flashinfer module, or a ConfigError that names the install command."""
    try:
        import flashinfer
    except (ImportError, OSError) as e:
        raise ConfigError(f"attention_provider='flashinfer' needs the flashinfer package, which did not import "
                          f"({e!r}); install it with `{PIP_INSTALL}` (it also needs apache-tvm-ffi and nvcc "
                          "for its first-use kernel build), or use attention_provider='triton'") from e
    return flashinfer


def decode_uses_tensor_cores(num_qo_heads: int, num_kv_heads: int) -> bool:
    """FlashInfer's tensor-core decode from a GQA group of 4 (bench_gpu times both kernels)."""
    return num_qo_heads // num_kv_heads >= 4


def paged_metadata(view: LayerView, page_size: int):
    """FlashInfer's CSR page layout of a view -> (indptr [B+1] int32 host, indices [pages]
    int32 device, last_page_len [B] int32 host)."""
    indptr, flat, last_page_len = page_csr(view.kv_lens_list, page_size, view.page_table.shape[1])
    indices = view.page_table.reshape(-1)[torch.from_numpy(flat).to(view.page_table.device)].to(torch.int32)
    return (torch.from_numpy(indptr.astype(np.int32)), indices,
            torch.from_numpy(last_page_len.astype(np.int32)))


class FlashInferAttentionProvider(AttentionProvider):
    name = "flashinfer"

    def __init__(self, device: torch.device, decode_tensor_cores: bool | None = None,
                 split_plan: str = "auto") -> None:
        """``decode_tensor_cores``: None picks by GQA group (``decode_uses_tensor_cores``);
        ``split_plan``: the Triton ops' split-K plan (``TritonAttentionProvider``)."""
        if device.type != "cuda":
            raise ConfigError(f"attention_provider='flashinfer' needs a CUDA device (got {device.type!r}) and the "
                              f"flashinfer package (`{PIP_INSTALL}`); on CPU use 'torch' or 'auto'")
        self.flashinfer = import_flashinfer()
        self.version = self.flashinfer.__version__
        self.device = device
        self.decode_tensor_cores = decode_tensor_cores
        self.triton = TritonAttentionProvider(split_plan)
        self._workspace: torch.Tensor | None = None  # allocated at the first plan
        self._wrappers: dict[tuple, list] = {}  # reused across steps: (kind, tensor_cores) -> wrappers
        self._step = lambda: None  # weak reference to the step planned for (a ctx holds the KV pool)
        self._plans: dict[tuple, tuple[LayerView, object]] = {}
        self._taken: dict[tuple, int] = {}
        self._graph_plans: FlashInferGraphPlans | None = None  # made at the first graph plan

    def ops(self) -> dict[str, str]:
        return {op: self.name if op in FLASHINFER_OPS else impl for op, impl in self.triton.ops().items()}

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping):
        kernels.paged_kv_write_triton(k, v, k_cache, v_cache, slot_mapping)

    def rotate_write_kv(self, q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
        return self.triton.rotate_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext,
               view: LayerView, selection: Selection | None, score_rows: ScoreRows | None, block_mask=None):
        if block_mask is not None:  # block-sparse prefill rows
            return self.triton.attend(q, k_cache, v_cache, ctx, view, selection, score_rows, block_mask)
        if ctx.is_decode:
            if score_rows is not None:  # Triton computes the output and the column sums in one pass
                return self.triton.attend(q, k_cache, v_cache, ctx, view, selection, score_rows)
            if selection is not None and not any(selection.dense):
                return self.triton.attend(q, k_cache, v_cache, ctx, view, selection, None)
            if selection is None or all(selection.dense):
                return self._plan(q, k_cache, ctx, view).run(q.contiguous(), (k_cache, v_cache)), None
            out = torch.empty_like(q)
            self._one_row_requests_into(out, q, k_cache, v_cache, ctx, view, selection, range(len(ctx.q_lens)))
            return out, None
        check_prefill_scores(score_rows)
        one = self._one_row_requests(ctx)
        if one:  # a mixed step's decode rows leave FlashInfer's prefill
            out = self._routed_prefill(q, k_cache, v_cache, ctx, view, selection, one)
        else:
            out = self._prefill(q, k_cache, v_cache, ctx, view, selection)
        colsums = None if score_rows is None else self._window_colsums(q, k_cache, ctx, view, score_rows)
        return out, colsums

    @staticmethod
    def _one_row_requests(ctx: StepContext) -> tuple[int, ...]:
        """With ``triton_provider.ROUTE_DECODE_ROWS`` (the A/B knob both providers read): a
        mixed step's requests that bring one query row; () when none, or when every
        request does."""
        if not triton_provider.ROUTE_DECODE_ROWS:
            return ()
        one = tuple(b for b, n in enumerate(ctx.q_lens) if n == 1)
        return one if len(one) < len(ctx.q_lens) else ()

    def _routed_prefill(self, q, k_cache, v_cache, ctx, view, selection, one):
        """FlashInfer's paged prefill planned over the requests with more than one row, its
        paged decode over the one-row requests that read their whole cache, the Triton
        sparse decode for those that read a selection (each group's rows of q gathered)."""
        out = torch.empty_like(q)
        one_set = set(one)
        chunks = ctx.group(b for b in range(len(ctx.q_lens)) if b not in one_set)
        chunks.put_rows(out, self._plan(q, k_cache, ctx, view, chunks).run(chunks.rows_of(q), (k_cache, v_cache)))
        self._one_row_requests_into(out, q, k_cache, v_cache, ctx, view, selection, one)
        return out

    def _one_row_requests_into(self, out, q, k_cache, v_cache, ctx, view, selection, requests):
        """Fill ``out``'s rows of the listed one-row requests: those that read their whole
        cache from FlashInfer's paged decode planned over them, the others only their
        selection (the Triton sparse decode); each kernel reads only its own rows."""
        sparse = () if selection is None else tuple(b for b in requests if not selection.dense[b])
        sparse_set = set(sparse)
        dense = tuple(b for b in requests if b not in sparse_set)
        if dense:
            rows = ctx.group(dense)
            rows.put_rows(out, self._plan(q, k_cache, ctx, view, rows).run(rows.rows_of(q), (k_cache, v_cache)))
        if sparse:
            rows = ctx.group(sparse)
            cut = rows.view(view)
            rows.put_rows(out, self.triton._sparse_decode(rows.rows_of(q), k_cache, v_cache, cut.page_table,
                                                          cut.kv_lens, selection.take(sparse, rows.reqs)))

    def _prefill(self, q, k_cache, v_cache, ctx, view, selection):
        """FlashInfer's paged prefill over every row; without the routing, decode rows that
        have a selection are computed again over it."""
        table, lens = view.page_table, view.kv_lens
        out = self._plan(q, k_cache, ctx, view).run(q.contiguous(), (k_cache, v_cache))
        if selection is not None:  # decode rows of a mixed batch read only their selection
            last = torch.tensor(np.cumsum(ctx.q_lens) - 1, device=q.device)
            sparse = self.triton._sparse_decode(q[last], k_cache, v_cache, table, lens, selection)
            use = torch.tensor([not d and n == 1 for d, n in zip(selection.dense, ctx.q_lens)], device=q.device)
            out[last] = torch.where(use[:, None, None], sparse, out[last])
        return out

    # ---- planning -------------------------------------------------------------------
    def plan_graph_step(self, graph, lens, table, k_cache, num_qo_heads):
        dtype, (page_size, hkv, d) = k_cache.dtype, k_cache.shape[1:]
        self._check_dtypes(dtype, dtype)
        if self._graph_plans is None:
            tensor_cores = self.decode_tensor_cores
            if tensor_cores is None:
                tensor_cores = decode_uses_tensor_cores(num_qo_heads, hkv)
            self._graph_plans = FlashInferGraphPlans(self.flashinfer, self._float_workspace(), tensor_cores)
        return self._graph_plans.plan(graph, lens, table, page_size, num_qo_heads, hkv, d, dtype)

    def graph_layouts(self) -> dict:
        """Per decode graph, the plan each layer reads (``FlashInferGraphPlans.layouts``)."""
        return {} if self._graph_plans is None else self._graph_plans.layouts()

    @staticmethod
    def _check_dtypes(q_dtype, kv_dtype) -> None:
        if q_dtype not in (torch.float16, torch.bfloat16) or kv_dtype != q_dtype:
            raise ConfigError(f"attention_provider='flashinfer' runs float16/bfloat16 attention; got q {q_dtype}, "
                              f"cache {kv_dtype}: use dtype='bfloat16' or attention_provider='triton'")

    def _graph_wrapper(self, ctx: StepContext, view: LayerView, group: RequestGroup | None):
        """In a decode graph's context: the graph wrapper of ``view``'s layer, planned by
        ``plan_graph_step`` before this capture or replay."""
        layer = next((i for i, v in enumerate(ctx.views) if v is view), None)
        if group is not None or layer is None or self._graph_plans is None:
            raise RuntimeError("attention_provider='flashinfer' in a decode graph plans whole-cache decode over "
                               "every row of a layer's view only (planned by plan_graph_step before the capture)")
        return self._graph_plans.wrapper(ctx.graph, layer)

    def _float_workspace(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        return self._workspace

    def _plan(self, q: torch.Tensor, k_cache: torch.Tensor, ctx: StepContext, view: LayerView,
              group: RequestGroup | None = None):
        """The planned wrapper for this step and view (or for ``group``'s requests of them):
        planned at its first layer, reused by the others. In a decode graph's context: the
        graph wrapper of the view's layer."""
        self._check_dtypes(q.dtype, k_cache.dtype)
        if ctx.graph is not None:
            return self._graph_wrapper(ctx, view, group)
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("attention_provider='flashinfer' cannot run inside a CUDA graph capture outside the "
                               "engine's decode graphs: its plan needs the step's host-side lengths (the engine plans "
                               "them before each replay); run such a step with enforce_eager=True")
        if ctx is not self._step():  # a dead reference never matches, even at a reused address
            self._step, self._plans, self._taken = weakref.ref(ctx), {}, {}
        page_size, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        hq = q.shape[1]
        key = (id(view), None if group is None else group.requests, hq, hkv, d, page_size, q.dtype)
        planned = self._plans.get(key)
        if planned is not None:
            return planned[1]
        held = view
        if group is not None:
            ctx, view = group.step, group.view(view)
        indptr, indices, last_page_len = paged_metadata(view, page_size)
        if ctx.is_decode:
            tensor_cores = self.decode_tensor_cores
            if tensor_cores is None:
                tensor_cores = decode_uses_tensor_cores(hq, hkv)
            wrapper = self._wrapper(("decode", tensor_cores))
            wrapper.plan(indptr, indices, last_page_len, hq, hkv, d, page_size,
                         pos_encoding_mode="NONE", q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        else:
            qo_indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(ctx.q_lens)]).astype(np.int32))
            wrapper = self._wrapper(("prefill", None))
            wrapper.plan(qo_indptr, indptr, indices, last_page_len, hq, hkv, d, page_size,
                         causal=True, pos_encoding_mode="NONE", q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        self._plans[key] = (held, wrapper)  # the view is held, so its id stays unique this step
        return wrapper

    def _wrapper(self, kind: tuple):
        """A wrapper of this kind not yet planned this step (each holds one plan)."""
        fi = self.flashinfer
        self._float_workspace()
        pool = self._wrappers.setdefault(kind, [])
        n = self._taken.get(kind, 0)
        if n == len(pool):
            if kind[0] == "decode":
                pool.append(fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD",
                                                                  use_tensor_cores=kind[1], backend="fa2"))
            else:
                pool.append(fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2"))
        self._taken[kind] = n + 1
        return pool[n]

    # ---- column sums (Triton) -----------------------------------------------------------
    @staticmethod
    def _window_colsums(q, k_cache, ctx, view, score_rows):
        """Per request [Hkv, kv_len] column sums over its last score_rows.rows[b] query rows."""
        max_len = max(view.kv_lens_list)
        by_window = {w: kernels.prefill_window_colsum_triton(q, k_cache, view.page_table, view.kv_lens,
                                                             ctx.cu_q_lens, w, max_kv_len=max_len)
                     for w in sorted(set(score_rows.rows)) if w > 0}
        hkv = k_cache.shape[2]
        return [by_window[w][b, :, :n] if w > 0 else torch.zeros(hkv, n, device=q.device)
                for b, (w, n) in enumerate(zip(score_rows.rows, view.kv_lens_list))]
