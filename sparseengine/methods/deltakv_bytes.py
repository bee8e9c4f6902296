"""DeltaKV's byte accounting. What the codec stores for ``n`` tokens of one layer, from
the shapes alone (:class:`ByteAccount`, :func:`stored_bytes_per_token`; it matches
``DeltaKVEncoded.nbytes``); what one request keeps in the engine, measured from the
tensors it holds (:class:`DeltaKVBytes`, :func:`request_bytes`); and what a decode step's
rebuild reads from the codec (:func:`rebuild_read_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseengine.methods.deltakv_codec import (QUANT_GROUP, index_dtype, _latent_bits_arg, center_stride,
                                                num_centers)
from sparseengine.methods.selection import _int_arg


@dataclass(frozen=True)
class ByteAccount:
    """Bytes of one layer's history of ``n`` tokens, compressed and dense."""

    n: int
    centers: int
    center_bytes: int  # raw centers
    latent_bytes: int  # latents (+ int4 scales and mins)
    index_bytes: int  # neighbour indices
    dense_bytes: int

    @property
    def stored_bytes(self) -> int:
        return self.center_bytes + self.latent_bytes + self.index_bytes

    @property
    def stored_per_token(self) -> float:
        return self.stored_bytes / self.n

    @property
    def dense_per_token(self) -> float:
        return self.dense_bytes / self.n

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.dense_bytes


def stored_bytes_per_token(n: int, num_kv_heads: int, head_dim: int, latent_dim: int,
                           center_ratio: float, neighbors: int, latent_bits: int,
                           kv_bytes: int = 2) -> ByteAccount:
    """What ``deltakv_codec.encode`` stores for ``n`` tokens (matches ``DeltaKVEncoded.nbytes``)
    against dense K and V of ``kv_bytes`` per element."""
    n = _int_arg("n", n, minimum=1)
    dim = 2 * _int_arg("num_kv_heads", num_kv_heads, 1) * _int_arg("head_dim", head_dim, 1)
    r = _int_arg("deltakv_latent_dim", latent_dim, minimum=1)
    k = _int_arg("deltakv_neighbors", neighbors, minimum=1)
    bits = _latent_bits_arg(latent_bits)
    kv_bytes = _int_arg("kv_bytes", kv_bytes, minimum=1)
    c = num_centers(n, center_stride(center_ratio))
    if bits == 4:
        if r % QUANT_GROUP:
            raise ValueError(f"deltakv_latent_dim must be a multiple of {QUANT_GROUP} for int4, got {r}")
        per_latent = r // 2 + (r // QUANT_GROUP) * 2 * 2  # codes + f16 scale + f16 min
    else:
        per_latent = 2 * r
    idx_bytes = torch.tensor([], dtype=index_dtype(c)).element_size()
    return ByteAccount(
        n=n, centers=c, center_bytes=c * dim * kv_bytes, latent_bytes=(n - c) * per_latent,
        index_bytes=(n - c) * k * idx_bytes, dense_bytes=n * dim * kv_bytes,
    )


@dataclass(frozen=True)
class DeltaKVBytes:
    """Bytes one request keeps, from the tensors held, against dense K+V of all layers."""

    tokens: int  # tokens with KV (the full layers' length)
    dense: int  # tokens x layers x 2 x Hkv x d x element size
    full_layers: int  # raw KV of the full layers
    raw_sparse: int  # raw sink + scratch + tail slots of the sparse layers
    centers: int
    latents: int  # latents (+ int4 scales and mins)
    indices: int  # neighbour indices
    pool: int  # bytes of the pool pages its page table pins (all layers)

    @property
    def stored(self) -> int:
        return self.full_layers + self.raw_sparse + self.centers + self.latents + self.indices

    @property
    def ratio(self) -> float:
        return self.stored / self.dense if self.dense else 1.0

    @property
    def per_token(self) -> float:
        return self.stored / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "stored": self.stored, "ratio": self.ratio, "per_token": self.per_token}


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def request_bytes(layer_lens: list[int], encs: list, full: list[int], sparse: list[int], num_layers: int,
                  token_bytes: int, pool_tokens: int) -> DeltaKVBytes:
    """What a request keeps: ``layer_lens`` its cached tokens per layer, ``encs`` its sparse
    layers' codec stores (``CodecStore``: the used rows only), ``token_bytes`` raw K+V of
    one token and layer, ``pool_tokens`` the token slots its page table pins."""
    tokens = max(layer_lens) if layer_lens else 0
    return DeltaKVBytes(
        tokens=tokens, dense=tokens * num_layers * token_bytes,
        full_layers=sum(layer_lens[layer] for layer in full) * token_bytes,
        raw_sparse=sum(layer_lens[layer] for layer in sparse) * token_bytes,
        centers=sum(_size(e.centers) for e in encs),
        latents=sum(_size(e.latents) + _size(e.scales) + _size(e.zeros) for e in encs),
        indices=sum(_size(e.neighbors) for e in encs),
        pool=pool_tokens * num_layers * token_bytes,
    )


def rebuild_read_bytes(encs: list, budget: int, kv_bytes_per_token_layer: int) -> int:
    """Per decode step, over the sparse layers' codec stores ``encs``: the latents,
    neighbour indices and neighbour centers of the history tokens chosen (up to ``budget``:
    the fused rebuild reads nothing for the others), and writing them into the scratch
    slots (``Up`` is shared by the batch and not counted)."""
    total = 0
    for enc in encs:
        rows = max(1, enc.latents.shape[0])
        latent = (_size(enc.latents) + enc.scales.numel() * 2 + enc.zeros.numel() * 2) / rows
        index = enc.neighbors.shape[1] * enc.neighbors.element_size()
        center = enc.neighbors.shape[1] * enc.centers.shape[1] * enc.centers.element_size()
        total += int(min(budget, enc.n) * (latent + index + center + kv_bytes_per_token_layer))
    return total
