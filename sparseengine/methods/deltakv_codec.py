"""DeltaKV codec: residual compression of one layer's KV history (METHODS.md, deltakv).

A token's vector is ``kv = [K | V]``, its pre-RoPE keys and values flattened and
concatenated: ``D = 2 * Hkv * d`` (:func:`concat_kv` / :func:`split_kv`; cached keys are
rotated, :func:`unrotate_keys` / :func:`rotate_keys` take them to pre-RoPE and back).

- Centers: every ``s = round(1 / center_ratio)``-th token, positions ``0, s, 2s, ...``,
  stored raw in the input dtype.
- Every other token t stores the indices of its ``neighbors`` nearest centers (L2 in kv
  space, among centers at positions ``< t``; fewer when fewer exist, padded with -1) and
  ``z = (kv_t - mean of those centers) @ Down`` with ``Down [D, r]``, as float16
  (``latent_bits=16``) or int4 (``latent_bits=4``: groups of 32, float16 scale and min
  per group, two codes per byte).
- Decode: ``kv = z @ Up + mean of the same centers`` with ``Up [r, D]``; centers come
  back bit-exact. RoPE is re-applied to K by the caller.

Error bound (what the tests check). Let R ``[N, D]`` be the residuals, ``R = U S W^T``
its SVD with singular values ``s_1 >= s_2 >= ...``, and ``Down = W_r`` (top-r right
singular vectors), ``Up = W_r^T`` (``deltakv_fit.fit_down_up``). Then
``R Down Up = R W_r W_r^T`` is the orthogonal projection of each row onto span(W_r),
and by Eckart-Young ``||R - R W_r W_r^T||_F^2 = sum_{i>r} s_i^2``, the least error any
rank-r linear Down/Up pair can reach. With ``r = D`` that sum is zero: reconstruction
is exact up to float error. Storing ``z`` lossily adds ``dz``; since Up has orthonormal
rows, ``||dz Up||_F = ||dz||_F`` and by the triangle inequality
``||R - R_hat||_F <= sqrt(sum_{i>r} s_i^2) + ||dz||_F``, where
``|dz| <= 2^-11 |z|`` elementwise for float16 and ``|dz| <= step / 2`` for int4 (step =
the group's scale; codes are ``round((z - min) / step)`` with min rounded down and step
rounded up to float16, so every z of the group lies in ``[min, min + 15 step]``).
Centers contribute no error. Decoded kv error equals residual error exactly, because
encode and decode take the mean of the same stored centers.

Fitting Down/Up and the checkpoint file that carries them: ``deltakv_fit``; what the codec
stores, in bytes: ``deltakv_bytes``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparseengine.layers.rotary import apply_rotary
from sparseengine.methods.deltakv_nearest import gather_centers, nearest_centers, neighbor_mean

QUANT_GROUP = 32
LATENT_BITS = (4, 16)


# ----------------------------------------------------------------------------- checks


from sparseengine.methods.selection import _int_arg  # noqa: E402  (one validator for both)


def _matrix_arg(name: str, t, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a floating tensor {layout}, got {got}")
    return t


def _latent_bits_arg(bits) -> int:
    if bits not in LATENT_BITS:
        raise ValueError(f"deltakv_latent_bits must be one of {LATENT_BITS}, got {bits!r}")
    return int(bits)


def center_stride(center_ratio: float) -> int:
    """``round(1 / center_ratio)`` (half up): one token in that many is a center."""
    if isinstance(center_ratio, bool) or not isinstance(center_ratio, (int, float)):
        raise ValueError(f"deltakv_center_ratio must be a number in (0, 1], got {center_ratio!r}")
    if not 0 < center_ratio <= 1:
        raise ValueError(f"deltakv_center_ratio must be in (0, 1], got {center_ratio!r}")
    return max(1, int(math.floor(1.0 / center_ratio + 0.5)))


def num_centers(n: int, stride: int) -> int:
    return -(-n // stride)


def index_dtype(centers: int) -> torch.dtype:
    return torch.int16 if centers <= torch.iinfo(torch.int16).max else torch.int32


# ---------------------------------------------------------------------- kv flattening


def concat_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[n, Hkv, d]`` pre-RoPE keys and values -> ``[n, 2 * Hkv * d]`` (K first)."""
    if not isinstance(k, torch.Tensor) or k.dim() != 3 or not isinstance(v, torch.Tensor):
        raise ValueError("k and v must be tensors [n, Hkv, d]")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} shapes differ")
    return torch.cat([k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)], dim=1)


def split_kv(kv: torch.Tensor, num_kv_heads: int, head_dim: int):
    """Inverse of :func:`concat_kv`: ``(k, v)``, each ``[n, Hkv, d]``."""
    hkv = _int_arg("num_kv_heads", num_kv_heads, minimum=1)
    d = _int_arg("head_dim", head_dim, minimum=1)
    if kv.dim() != 2 or kv.shape[1] != 2 * hkv * d:
        raise ValueError(f"kv must be [n, 2*Hkv*d] = [n, {2 * hkv * d}], got {tuple(kv.shape)}")
    k, v = kv.split(hkv * d, dim=1)
    return k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)


# ------------------------------------------------------------------------------ rope


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin [n, d]`` of ``positions``, computed as the model computes them."""
    freqs = positions.float()[:, None] * inv_freq.float().to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_keys(k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Apply RoPE at ``positions`` to ``k [n, Hkv, d]`` (float32 result)."""
    cos, sin = rope_cos_sin(inv_freq, positions)
    return apply_rotary(k.float(), cos, sin)


def unrotate_keys(k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE keys of cached (rotated) ``k [n, Hkv, d]``: rotate by ``-position``."""
    cos, sin = rope_cos_sin(inv_freq, positions)
    return apply_rotary(k.float(), cos, -sin)


# ---------------------------------------------------------------------- neighbourhood


def _neighbor_mean(centers: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Mean ``[m, D]`` (float32) of the stored centers ``[C, D]`` named by ``idx [m, K]``
    (-1 = none); the rows named are gathered first (converting the whole table would move
    all C rows per call)."""
    return neighbor_mean(centers[idx.long().clamp(min=0)], idx)


def residuals(kv: torch.Tensor, center_ratio: float, neighbors: int):
    """``(res [N, D] float32, idx [N, neighbors])`` for the non-center tokens of ``kv``
    in order: the calibration input of ``deltakv_fit.fit_down_up``."""
    _matrix_arg("kv", kv, "[n, D]")
    stride = center_stride(center_ratio)
    k = _int_arg("deltakv_neighbors", neighbors, minimum=1)
    pos = torch.arange(kv.shape[0], device=kv.device)
    is_center = pos % stride == 0
    centers, others = kv[is_center], pos[~is_center]
    idx = nearest_centers([centers], kv[:0][None], stride, kv[others][None], others, k)[0]
    return kv[others].float() - _neighbor_mean(centers, idx), idx


# ------------------------------------------------------------------------------- int4


def _finite_or_raise(finite: torch.Tensor, message: str, defer: list | None) -> None:
    """Raise ``ValueError(message)`` unless ``finite`` (a 0-d bool tensor); with ``defer`` (a
    list) append ``(finite, message)`` to it instead: the caller checks later, so that this
    step need not wait for the device."""
    if defer is not None:
        defer.append((finite, message))
    elif not finite:  # one device sync
        raise ValueError(message)


def quantize_int4(z: torch.Tensor, defer: list | None = None):
    """``z [N, r]`` (r a multiple of 32) -> ``(packed uint8 [N, r/2], scale f16 [N, r/32],
    zero f16 [N, r/32])``. Per group of 32: ``zero <= min(z)`` and ``15 * scale >=
    max(z) - zero`` after rounding to float16, codes ``round((z - zero) / scale)``, so
    ``|dequantize - z| <= scale / 2`` (+ float32 rounding). A scale or min that overflows
    float16 raises (``defer``: see ``_finite_or_raise``)."""
    _matrix_arg("z", z, "[N, r]")
    n, r = z.shape
    if r % QUANT_GROUP:
        raise ValueError(f"deltakv_latent_dim must be a multiple of {QUANT_GROUP} for int4, got {r}")
    zg = z.float().view(n, r // QUANT_GROUP, QUANT_GROUP)
    lo, hi = zg.amin(dim=-1), zg.amax(dim=-1)
    zero = lo.half()
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, -math.inf)), zero)
    step = (hi - zero.float()) / 15
    scale = step.half()
    scale = torch.where(scale.float() < step, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    _finite_or_raise(torch.isfinite(zero).all() & torch.isfinite(scale).all(),
                     "latent values overflow the float16 int4 scale/min; use deltakv_latent_bits=16", defer)
    sf = scale.float()[..., None]
    codes = torch.where(sf > 0, torch.round((zg - zero.float()[..., None]) / sf.clamp(min=1e-30)), 0.0)
    codes = codes.clamp(0, 15).to(torch.uint8).view(n, r)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, scale, zero


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, r/2]`` -> codes uint8 ``[N, r]`` (low nibble = even index)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Exact inverse map of the stored codes: ``code * scale + zero`` in float32."""
    codes = unpack_int4(packed).float()
    n, r = codes.shape
    g = codes.view(n, r // QUANT_GROUP, QUANT_GROUP)
    return (g * scale.float()[..., None] + zero.float()[..., None]).view(n, r)


# ---------------------------------------------------------------------- encode/decode


@dataclass(frozen=True)
class DeltaKVEncoded:
    """One layer's compressed history of ``n`` tokens. Centers sit at positions
    ``i * stride``; the j-th non-center token owns row j of ``neighbors``/``latents``/
    ``scales``/``zeros`` (the last two empty for 16-bit latents)."""

    n: int
    stride: int
    latent_bits: int
    centers: torch.Tensor  # [C, D], input dtype
    neighbors: torch.Tensor  # [n - C, K] int16/int32, -1 padded
    latents: torch.Tensor  # [n - C, r] float16, or [n - C, r/2] uint8 packed int4
    scales: torch.Tensor  # [n - C, r/32] float16 (int4 only)
    zeros: torch.Tensor  # [n - C, r/32] float16 (int4 only)

    def nbytes(self) -> int:
        """Bytes actually stored (positions are implicit and cost nothing)."""
        parts = (self.centers, self.neighbors, self.latents, self.scales, self.zeros)
        return sum(t.numel() * t.element_size() for t in parts)

    def dense_latents(self) -> torch.Tensor:
        """The stored latents as float32 ``[n - C, r]``."""
        if self.latent_bits == 4:
            return dequantize_int4(self.latents, self.scales, self.zeros)
        return self.latents.float()


def _store_latents(z: torch.Tensor, bits: int, defer: list | None = None):
    empty = z.new_zeros((z.shape[0], 0), dtype=torch.float16)
    if bits == 4:
        return quantize_int4(z, defer)
    lat = z.half()
    _finite_or_raise(torch.isfinite(lat).all(), "latent values overflow float16 (deltakv_latent_bits=16)", defer)
    return lat, empty, empty


def encode_tail(centers_old, n_old, kv_new, down, stride, neighbors, bits):
    """Encode tokens at positions ``n_old ...`` after a history with centers
    ``centers_old``: ``(centers`` old and new, and the new others' ``neighbors, latents,
    scales, zeros)``."""
    new, idx, lat, scales, zeros = encode_tail_layers(centers_old[None], n_old, kv_new[None], down[None], stride,
                                                      neighbors, bits)
    return torch.cat([centers_old, new[0]]), idx[0], lat[0], scales[0], zeros[0]


def encode_tail_layers(centers_old, n_old, kv_new, downs, stride, neighbors, bits, defer: list | None = None):
    """`encode_tail` of L layers whose histories have the same length (a request's sparse
    layers at a history flush), in a few batched ops instead of L rounds of small ones:
    ``centers_old``: L tensors ``[c, D]`` (or one ``[L, c, D]``; read where they are, never
    copied: ``deltakv_nearest``), ``kv_new [L, m, D]``, ``downs [L, D, r]``. Returns the new
    parts, stacked by layer: ``(centers [L, c_new, D], neighbors [L, mo, K], latents,
    scales, zeros [L, mo, ...])``. ``defer``: the latents' overflow check is appended to it
    instead of waiting for the device (``_finite_or_raise``)."""
    L, m, D = kv_new.shape
    center_rows, other_rows = split_rows(n_old, m, stride, kv_new.device)
    olds = list(centers_old)
    new_centers = kv_new.index_select(1, center_rows).to(olds[0].dtype)  # [L, c_new, D]
    others = kv_new.index_select(1, other_rows)
    idx = nearest_centers(olds, new_centers, stride, others, n_old + other_rows, neighbors)
    res = others.float() - neighbor_mean(gather_centers(olds, new_centers, idx), idx)
    z = torch.bmm(res, downs.float())
    mo = others.shape[1]
    lat, scales, zeros = (t.view(L, mo, *t.shape[1:]) for t in _store_latents(z.flatten(0, 1), bits, defer))
    return new_centers, idx.to(index_dtype(olds[0].shape[0] + new_centers.shape[1])), lat, scales, zeros


def split_rows(n_old: int, m: int, stride: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``m`` tokens at positions ``n_old ...`` that are centers (position a multiple
    of ``stride``) and the others, each ascending, computed from the integers alone (no
    boolean mask: indexing by one would sync the device with the host)."""
    first = (-n_old) % stride  # the first center row
    centers = torch.arange(first, max(first, m), stride, device=device)
    # the j-th other row: the `first` rows before the first center, then stride - 1 rows
    # after each center
    j = torch.arange(m - centers.numel(), device=device)
    k = (j - first).clamp(min=0)
    return centers, torch.where(j < first, j, first + 1 + k + k // max(stride - 1, 1))


def _check_down(down: torch.Tensor, dim: int) -> torch.Tensor:
    _matrix_arg("down", down, "[D, r]")
    if down.shape[0] != dim:
        raise ValueError(f"down must be [D={dim}, r], got {tuple(down.shape)}")
    return down


def encode(kv: torch.Tensor, down: torch.Tensor, *, center_ratio: float, neighbors: int,
           latent_bits: int = 4) -> DeltaKVEncoded:
    """Compress ``kv [n, D]`` (see :func:`concat_kv`) with ``down [D, r]``."""
    _matrix_arg("kv", kv, "[n, D]")
    _check_down(down, kv.shape[1])
    stride = center_stride(center_ratio)
    k = _int_arg("deltakv_neighbors", neighbors, minimum=1)
    bits = _latent_bits_arg(latent_bits)
    parts = encode_tail(kv[:0], 0, kv, down, stride, k, bits)
    return DeltaKVEncoded(kv.shape[0], stride, bits, *parts)


def extend(enc: DeltaKVEncoded, kv_new: torch.Tensor, down: torch.Tensor) -> DeltaKVEncoded:
    """Append tokens at positions ``enc.n ...``; equals encoding all tokens at once."""
    _matrix_arg("kv_new", kv_new, "[m, D]")
    _check_down(down, enc.centers.shape[1])
    if kv_new.shape[1] != enc.centers.shape[1]:
        raise ValueError(f"kv_new must be [m, {enc.centers.shape[1]}], got {tuple(kv_new.shape)}")
    centers, idx, lat, scales, zeros = encode_tail(
        enc.centers, enc.n, kv_new, down, enc.stride, enc.neighbors.shape[1], enc.latent_bits
    )
    idx_dtype = index_dtype(centers.shape[0])
    return DeltaKVEncoded(
        enc.n + kv_new.shape[0], enc.stride, enc.latent_bits, centers,
        torch.cat([enc.neighbors.to(idx_dtype), idx]),
        torch.cat([enc.latents, lat]), torch.cat([enc.scales, scales]),
        torch.cat([enc.zeros, zeros]),
    )


def decode(enc: DeltaKVEncoded, up: torch.Tensor, positions: torch.Tensor | None = None):
    """Rebuild tokens (all, or the LongTensor ``positions``) as float32 ``[m, D]``:
    centers exactly, others ``z @ up + mean of their centers``."""
    _matrix_arg("up", up, "[r, D]")
    if up.shape[1] != enc.centers.shape[1]:
        raise ValueError(f"up must be [r, D={enc.centers.shape[1]}], got {tuple(up.shape)}")
    device = enc.centers.device
    if positions is None:
        positions = torch.arange(enc.n, device=device)
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.is_floating_point():
        raise ValueError("positions must be a 1-D integer tensor")
    if positions.numel() and (positions.min() < 0 or positions.max() >= enc.n):
        raise ValueError(f"positions must lie in [0, n={enc.n})")
    return decode_at(enc, up, positions)


def decode_at(enc: DeltaKVEncoded, up: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """:func:`decode` of ``positions`` the caller keeps in ``[0, n)``, unchecked: no host
    sync and shapes fixed by ``positions`` (every row is rebuilt both ways, then the
    center or the residual one is kept), for the engine's decode steps."""
    positions = positions.long()
    center = enc.centers[positions // enc.stride].float()
    if enc.latents.shape[0] == 0:  # every token a center
        return center
    row = (positions - positions // enc.stride - 1).clamp(min=0)  # non-center rank (centers: any row)
    if enc.latent_bits == 4:
        z = dequantize_int4(enc.latents[row], enc.scales[row], enc.zeros[row])
    else:
        z = enc.latents[row].float()
    other = z @ up.float() + _neighbor_mean(enc.centers, enc.neighbors[row])
    return torch.where((positions % enc.stride == 0)[:, None], center, other)
