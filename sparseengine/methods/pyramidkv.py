"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on
Pyramidal Information Funneling"): SnapKV scores with a budget that falls linearly with
depth (mean ``budget``, ratio ``pyramidkv_beta``). It needs the whole prompt's window
scores in one pass, hence its registry prefill policy. Memory returns in whole pages of
the longest layer: the shared page table is as long as the first layer's budget."""

from __future__ import annotations

from sparseengine.method_registry import MethodSpec
from sparseengine.methods.selection import pyramidkv_budgets
from sparseengine.methods.snapkv import SnapKV


class PyramidKV(SnapKV):
    def layer_budget(self, layer: int, n: int) -> int:
        budgets = pyramidkv_budgets(self.model.num_layers, self.config.budget,
                                    float(self.knob("pyramidkv_beta")), n, self.window)
        return budgets[layer]


SPEC = MethodSpec(
    name="pyramidkv", kind="decode", family="physical_eviction", runtime=PyramidKV,
    prefill_policy="long_bs1full_short_batch", needs_scores=True, frees_memory=True,
    knobs={"pyramidkv_beta": 20.0},
    paper="Cai et al., PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling, 2024")
