"""The paged KV pool: K and V each one buffer of token rows ``[rows, Hkv, d]``, every
layer a slice ``[pages, page_size, Hkv, d]`` of it.

Every layer holds ``num_pages`` pages, except the *narrow* layers (``narrow_layers``),
which hold only the first ``narrow_pages``: a method whose compressed layers keep a few
hundred tokens while the other layers keep every one (DeltaKV) gives those layers no
room for the pages past ``narrow_pages``, which only the other (*wide*) layers store.
Page ids below ``narrow_pages`` are valid in every layer; the allocator hands them to
whatever a narrow layer may hold (``PageAllocator``). With no narrow layers the pool is
the plain ``[L, num_pages, page_size, Hkv, d]`` tensor (``k``, ``v``)."""

from __future__ import annotations

import torch

from sparseengine.models.model_config import ModelConfig


def page_bytes(model: ModelConfig, page_size: int, dtype: torch.dtype, layers: int | None = None) -> int:
    """Bytes of K and V of one page in ``layers`` layers (default: all of the model's)."""
    elem = torch.empty((), dtype=dtype).element_size()
    n = model.num_layers if layers is None else layers
    return 2 * n * page_size * model.num_kv_heads * model.head_dim * elem


class KVCache:
    def __init__(self, model: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, narrow_layers=(), narrow_pages: int | None = None) -> None:
        narrow_layers = tuple(sorted(set(narrow_layers)))
        if narrow_layers and not (narrow_pages is not None and 0 < narrow_pages <= num_pages):
            raise ValueError(f"narrow layers need 0 < narrow_pages <= num_pages={num_pages}, got {narrow_pages}")
        if any(not 0 <= layer < model.num_layers for layer in narrow_layers):
            raise ValueError(f"narrow layers must lie in [0, {model.num_layers}), got {narrow_layers}")
        self.num_layers = model.num_layers
        self.num_pages = num_pages
        self.narrow_pages = narrow_pages if narrow_layers else num_pages
        self.narrow_layers = narrow_layers if self.narrow_pages < num_pages else ()
        self.page_size = page_size
        self.pages_of = [self.narrow_pages if layer in self.narrow_layers else num_pages
                         for layer in range(model.num_layers)]
        starts = [0]
        for pages in self.pages_of:
            starts.append(starts[-1] + pages * page_size)
        self.row_offsets = starts[:-1]  # each layer's first token row in the buffers
        shape = (starts[-1], model.num_kv_heads, model.head_dim)
        self.k_rows = torch.zeros(shape, dtype=dtype, device=device)
        self.v_rows = torch.zeros(shape, dtype=dtype, device=device)
        self._offsets_t = torch.tensor(self.row_offsets, dtype=torch.long, device=device)
        self._layers = [tuple(rows[off:off + pages * page_size].view(pages, page_size, *shape[1:])
                              for rows in (self.k_rows, self.v_rows))
                        for off, pages in zip(self.row_offsets, self.pages_of)]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[pages, page_size, Hkv, d]`` of one layer."""
        return self._layers[layer]

    @property
    def uniform(self) -> bool:
        return not self.narrow_layers

    @property
    def wide_layers(self) -> list[int]:
        return [layer for layer in range(self.num_layers) if layer not in self.narrow_layers]

    def _whole(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.uniform:
            raise ValueError(f"this pool's layers differ in pages (narrow layers {self.narrow_layers} hold "
                             f"{self.narrow_pages} of {self.num_pages}): use layer() or the token rows")
        return rows.view(self.num_layers, self.num_pages, self.page_size, *rows.shape[1:])

    @property
    def k(self) -> torch.Tensor:
        """``[L, num_pages, page_size, Hkv, d]`` (a pool with no narrow layers)."""
        return self._whole(self.k_rows)

    @property
    def v(self) -> torch.Tensor:
        return self._whole(self.v_rows)

    @property
    def dtype(self) -> torch.dtype:
        return self.k_rows.dtype

    @property
    def device(self) -> torch.device:
        return self.k_rows.device

    @property
    def num_kv_heads(self) -> int:
        return self.k_rows.shape[1]

    def offsets(self) -> torch.Tensor:
        """``row_offsets`` as an int64 tensor on the pool's device."""
        return self._offsets_t

    @property
    def nbytes(self) -> int:
        return self.k_rows.numel() * self.k_rows.element_size() * 2
