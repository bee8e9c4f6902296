"""Attention and cache kernels: each a plain torch reference (`*_ref`, the oracle) and a
Triton version (`*_triton`) with the same positional signature (Triton ones may add
keyword-only tuning knobs). Triton kernels are jitted at first launch; on CPU tensors
they need TRITON_INTERPRET=1 (tests only). Importing this package needs no Triton.
"""
from .attention_colsum import (decode_colsum_ref, decode_colsum_triton, prefill_window_colsum_ref,
                               prefill_window_colsum_triton)
from . import block_sparse_paged_prefill
from .block_sparse_paged_prefill import block_sparse_paged_prefill_ref, block_sparse_paged_prefill_triton
from .block_sparse_prefill import block_sparse_prefill_ref, block_sparse_prefill_triton
from .deltakv_rebuild import (codec_addresses, deltakv_rebuild_batched_ref, deltakv_rebuild_batched_triton,
                              deltakv_rebuild_ref, deltakv_rebuild_triton)
from .fused_ops import (add_rms_norm_ref, add_rms_norm_triton, rms_norm_ref, rms_norm_triton, rotary_kv_write_triton,
                        rotary_qk_ref, rotary_qk_triton, silu_mul_ref, silu_mul_triton)
from .h2o_scores import (h2o_scores_accumulate_ref, h2o_scores_accumulate_triton, h2o_victim_ref,
                         h2o_victim_triton)
from .omnikv_scores import (decode_max_logits_ref, decode_max_logits_triton, omnikv_scores_ref,
                            omnikv_scores_triton)
from .paged_decode import paged_decode_ref, paged_decode_triton
from .paged_kv_write import paged_kv_write_ref, paged_kv_write_triton
from .paged_prefill import paged_prefill_ref, paged_prefill_triton
from .quest import update_page_minmax_ref, update_page_minmax_triton
from .quest_scores import (middle_group_maxima_ref, quest_page_scores_and_maxima_triton, quest_page_scores_ref,
                           quest_page_scores_triton)
from .omnikv_select import omnikv_select_triton
from .quest_select import quest_select_pages_triton
from .row_argmax import row_argmax_ref, row_argmax_triton
from .skinny_linear import skinny_linear_ref, skinny_linear_triton
from .sparse_decode import (sparse_decode_ref, sparse_decode_triton, sparse_page_decode_ref,
                            sparse_page_decode_triton, sparse_rows_decode_ref, sparse_rows_decode_triton)

__all__ = [
    "add_rms_norm_ref",
    "add_rms_norm_triton",
    "block_sparse_paged_prefill",
    "block_sparse_paged_prefill_ref",
    "block_sparse_paged_prefill_triton",
    "block_sparse_prefill_ref",
    "block_sparse_prefill_triton",
    "decode_colsum_ref",
    "decode_colsum_triton",
    "decode_max_logits_ref",
    "decode_max_logits_triton",
    "codec_addresses",
    "deltakv_rebuild_batched_ref",
    "deltakv_rebuild_batched_triton",
    "deltakv_rebuild_ref",
    "deltakv_rebuild_triton",
    "h2o_scores_accumulate_ref",
    "h2o_scores_accumulate_triton",
    "h2o_victim_ref",
    "h2o_victim_triton",
    "middle_group_maxima_ref",
    "omnikv_scores_ref",
    "omnikv_scores_triton",
    "omnikv_select_triton",
    "paged_decode_ref",
    "paged_decode_triton",
    "paged_kv_write_ref",
    "paged_kv_write_triton",
    "paged_prefill_ref",
    "paged_prefill_triton",
    "prefill_window_colsum_ref",
    "prefill_window_colsum_triton",
    "quest_page_scores_and_maxima_triton",
    "quest_page_scores_ref",
    "quest_page_scores_triton",
    "quest_select_pages_triton",
    "rms_norm_ref",
    "rms_norm_triton",
    "rotary_kv_write_triton",
    "rotary_qk_ref",
    "rotary_qk_triton",
    "row_argmax_ref",
    "row_argmax_triton",
    "silu_mul_ref",
    "silu_mul_triton",
    "skinny_linear_ref",
    "skinny_linear_triton",
    "sparse_decode_ref",
    "sparse_decode_triton",
    "sparse_page_decode_ref",
    "sparse_page_decode_triton",
    "sparse_rows_decode_ref",
    "sparse_rows_decode_triton",
    "update_page_minmax_ref",
    "update_page_minmax_triton",
]
