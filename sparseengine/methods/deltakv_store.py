"""One request's compressed history of one DeltaKV layer, in buffers that keep their
addresses.

The codec (`deltakv_codec`) returns new tensors each time a history grows. The engine
instead keeps each request's codec in buffers sized for the longest history the request
can reach (prompt + max_tokens - sink - recent): appending encodes the new tokens and
writes them in place, so a CUDA graph captured once can keep reading the buffers while
the history grows. A history past the capacity reallocates (doubling) and bumps
`generation`, which tells a graph that read the old buffers to be captured again.

`view()` is the stored codec (`DeltaKVEncoded` over the used rows: what byte accounting
reads); `full()` is the same over the whole buffers, for
`deltakv_codec.decode_at` in a captured step (its gathers then never see a shape change;
rows past the used ones are never named by a valid position).

`RequestState`: a request's DeltaKV state, one store per sparse layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparseengine.kernels.deltakv_rebuild import codec_addresses
from sparseengine.methods import deltakv_codec as codec


class CodecStore:
    def __init__(self, capacity: int, stride: int, bits: int, neighbors: int, dim: int, latent_dim: int,
                 dtype: torch.dtype, device, addresses: torch.Tensor | None = None) -> None:
        self.stride, self.bits, self.neighbors = stride, bits, neighbors
        self.dim, self.latent_dim, self.dtype, self.device = dim, latent_dim, dtype, device
        self.n = self.c = self.m = 0  # tokens, centers, other tokens stored
        self.generation = 0
        # int64 [5] on the device: the buffers' addresses (kernels.codec_addresses), kept current
        # here, where a batched rebuild's captured step reads them
        self.addresses = torch.zeros(5, dtype=torch.int64, device=device) if addresses is None else addresses
        self._allocate(max(1, capacity))

    # Writes run in inference mode: a store made inside it (a synthesised prefill, under
    # the runner's inference mode) holds inference tensors, which only it may update.
    @torch.inference_mode()
    def _allocate(self, capacity: int) -> None:
        cap_c = codec.num_centers(capacity, self.stride)
        cap_m = capacity - cap_c
        r, dev = self.latent_dim, self.device
        old = (self.centers, self.neighbors_buf, self.latents, self.scales, self.zeros) if self.n else None
        self.capacity = capacity
        self.centers = torch.zeros(cap_c, self.dim, dtype=self.dtype, device=dev)
        self.neighbors_buf = torch.full((cap_m, self.neighbors), -1, dtype=codec.index_dtype(cap_c), device=dev)
        if self.bits == 4:
            groups = r // codec.QUANT_GROUP
            self.latents = torch.zeros(cap_m, r // 2, dtype=torch.uint8, device=dev)
            self.scales = torch.zeros(cap_m, groups, dtype=torch.float16, device=dev)
            self.zeros = torch.zeros(cap_m, groups, dtype=torch.float16, device=dev)
        else:
            self.latents = torch.zeros(cap_m, r, dtype=torch.float16, device=dev)
            self.scales = self.zeros = torch.zeros(cap_m, 0, dtype=torch.float16, device=dev)
        if old is not None:
            self._put(0, 0, *(t[: (self.c if i == 0 else self.m)] for i, t in enumerate(old)))
            self.generation += 1
        self.addresses.copy_(torch.tensor(codec_addresses(self.full()), dtype=torch.int64))

    def _targets(self, c0: int, m0: int, centers, neighbors, latents, scales, zeros) -> list[tuple]:
        """``(buffer rows, value)`` pairs that store these parts at center row ``c0`` and
        other row ``m0``."""
        m1 = m0 + neighbors.shape[0]
        return [(self.centers[c0:c0 + centers.shape[0]], centers),
                (self.neighbors_buf[m0:m1], neighbors.to(self.neighbors_buf.dtype)),
                (self.latents[m0:m1], latents), (self.scales[m0:m1], scales), (self.zeros[m0:m1], zeros)]

    def _put(self, c0: int, m0: int, *parts) -> None:
        for rows, value in self._targets(c0, m0, *parts):
            rows.copy_(value)

    @torch.inference_mode()
    def write(self, enc: codec.DeltaKVEncoded) -> None:
        """Store an encoded history (empty store): the first compression, or a
        synthesised one."""
        if self.n:
            raise RuntimeError("CodecStore.write: the store already holds a history; append to it")
        if enc.n > self.capacity:
            self._allocate(max(enc.n, 2 * self.capacity))
        self._put(0, 0, enc.centers, enc.neighbors, enc.latents, enc.scales, enc.zeros)
        self.n, self.c, self.m = enc.n, enc.centers.shape[0], enc.neighbors.shape[0]

    @torch.inference_mode()
    def append(self, kv_new: torch.Tensor, down: torch.Tensor) -> None:
        """Encode tokens at history positions ``n ...`` (as ``deltakv_codec.extend``) into the
        buffers."""
        centers, idx, lat, scales, zeros = codec.encode_tail(
            self.centers[: self.c], self.n, kv_new, down, self.stride, self.neighbors, self.bits)
        self.append_encoded(kv_new.shape[0], centers[self.c:], idx, lat, scales, zeros)

    @torch.inference_mode()
    def append_encoded(self, count: int, centers, neighbors, latents, scales, zeros) -> None:
        """Store the encoding of ``count`` tokens at history positions ``n ...`` (the new
        parts, as `deltakv_codec.encode_tail_layers` returns them for each layer)."""
        append_layers([self], count, *(part[None] for part in (centers, neighbors, latents, scales, zeros)))

    def _grow(self, count: int) -> tuple[int, int]:
        """Room for ``count`` more tokens (the buffers reallocated when outgrown); ``(c, m)``:
        the center and other rows where they go (the counts move on after the write)."""
        if self.n + count > self.capacity:
            self._allocate(max(self.n + count, 2 * self.capacity))
        return self.c, self.m

    def write_random(self, n: int, gen: torch.Generator) -> None:
        """Store a random history of ``n`` tokens with the shapes and sizes an encoding of
        n tokens has (a synthesised prefill: decode benchmarks); each token's neighbours are
        its nearest earlier centers by position."""
        dev, r, stride = self.device, self.latent_dim, self.stride
        c = codec.num_centers(n, stride)
        pos = torch.arange(n, device=dev)
        pos = pos[pos % stride != 0]
        near = pos[:, None] // stride - torch.arange(self.neighbors, device=dev)[None, :]
        idx = near.clamp(min=-1).to(codec.index_dtype(c))
        m = pos.numel()
        centers = torch.randn(c, self.dim, generator=gen, device=dev).to(self.dtype)
        if self.bits == 4:
            lat = torch.randint(0, 256, (m, r // 2), generator=gen, device=dev, dtype=torch.uint8)
            scales = (torch.rand(m, r // codec.QUANT_GROUP, generator=gen, device=dev) * 0.02).half()
            zeros = (-7.5 * scales.float()).half()
        else:
            lat = (0.1 * torch.randn(m, r, generator=gen, device=dev)).half()
            scales = zeros = torch.zeros(m, 0, dtype=torch.float16, device=dev)
        self.write(codec.DeltaKVEncoded(n, stride, self.bits, centers, idx, lat, scales, zeros))

    def view(self) -> codec.DeltaKVEncoded:
        return codec.DeltaKVEncoded(self.n, self.stride, self.bits, self.centers[: self.c],
                                    self.neighbors_buf[: self.m], self.latents[: self.m], self.scales[: self.m],
                                    self.zeros[: self.m])

    def full(self) -> codec.DeltaKVEncoded:
        return codec.DeltaKVEncoded(self.n, self.stride, self.bits, self.centers, self.neighbors_buf, self.latents,
                                    self.scales, self.zeros)


def same_history(stores: list[CodecStore]) -> int:
    """The history length (tokens) of stores that must hold equally long histories (a
    request's sparse layers); raises where they do not."""
    if len({(s.n, s.c, s.m) for s in stores}) > 1:
        raise RuntimeError(f"deltakv: the sparse layers' histories differ: {[(s.n, s.c, s.m) for s in stores]}")
    return stores[0].n


@torch.inference_mode()
def append_layers(stores: list[CodecStore], count: int, centers, neighbors, latents, scales, zeros) -> None:
    """`CodecStore.append_encoded` of many stores of one history length (a request's sparse
    layers at a flush), the parts stacked by store: written by one multi-tensor copy a
    dtype, not five copies a store."""
    same_history(stores)
    pairs = []
    for i, store in enumerate(stores):
        c0, m0 = store._grow(count)
        pairs += store._targets(c0, m0, centers[i], neighbors[i], latents[i], scales[i], zeros[i])
    for dtype in {rows.dtype for rows, _ in pairs}:  # a dtype a call: mixed lists copy tensor by tensor
        same = [(rows, value) for rows, value in pairs if rows.dtype == dtype]
        torch._foreach_copy_([rows for rows, _ in same], [value for _, value in same])
    for store in stores:
        store.n += count
        store.c, store.m = store.c + centers.shape[1], store.m + neighbors.shape[1]


STATE_KEY = "deltakv"  # a request's RequestState in its CacheManager state


@dataclass
class RequestState:
    """A request's DeltaKV state."""

    hist_end: int  # first token of the raw tail; tokens [sink, hist_end) are compressed
    stores: dict[int, CodecStore] = field(default_factory=dict)  # each sparse layer's codec
    hist_end_t: torch.Tensor | None = None  # hist_end on the device (a captured step reads it)
    addresses: torch.Tensor | None = None  # [sparse layers, 5]: row i, the i-th store's CodecStore.addresses
    # overflow checks of flushes not read yet: (host flag, event after its copy or None, message)
    checks: list = field(default_factory=list)

    def defer(self, checks: list) -> None:
        """Keep a flush's ``(finite, message)`` checks (``deltakv_codec._finite_or_raise``):
        on a GPU each flag goes to pinned host memory behind the work queued so far, and
        is read once it is there (``settle``), not now: the flush then waits for nothing."""
        for finite, message in checks:
            if finite.is_cuda:
                host = torch.empty((), dtype=torch.bool, pin_memory=True)
                host.copy_(finite, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self.checks.append((host, event, message))
            else:
                self.checks.append((finite, None, message))
        self.settle()

    def settle(self, wait: bool = False) -> None:
        """Raise the first failed check that has reached the host (``wait``: all of them)."""
        pending = []
        for host, event, message in self.checks:
            if event is not None and not event.query():
                if not wait:
                    pending.append((host, event, message))
                    continue
                event.synchronize()
            if not bool(host):
                self.checks = []
                raise ValueError(message)
        self.checks = pending

    @property
    def compressed(self) -> bool:
        """The sparse layers hold a compressed history (and scratch slots)."""
        return bool(self.stores)

    @property
    def enc(self) -> dict[int, codec.DeltaKVEncoded]:
        """Each sparse layer's stored codec (its used rows)."""
        return {layer: store.view() for layer, store in self.stores.items()}

    def address_row(self, i: int, layers: int, device) -> torch.Tensor:
        """Row ``i`` of the request's codec address table (made at its first store), for the
        i-th sparse layer's ``CodecStore`` to keep current."""
        if self.addresses is None:
            self.addresses = torch.zeros(layers, 5, dtype=torch.int64, device=device)
        return self.addresses[i]

    def graph_state(self) -> tuple:
        """What a captured decode step bakes in: whether the layers are compressed and the
        generation of every buffer it reads."""
        return self.compressed, tuple(st.generation for st in self.stores.values())
