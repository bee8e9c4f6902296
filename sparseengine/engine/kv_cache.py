"""The paged KV pool: one K and one V tensor ``[L, num_pages, page_size, Hkv, d]``;
each layer reads its slice."""

from __future__ import annotations

import torch

from sparseengine.models.model_config import ModelConfig


def page_bytes(model: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * page_size * model.num_kv_heads * model.head_dim * elem


class KVCache:
    def __init__(self, model: ModelConfig, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (model.num_layers, num_pages, page_size, model.num_kv_heads, model.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages = num_pages
        self.page_size = page_size

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
