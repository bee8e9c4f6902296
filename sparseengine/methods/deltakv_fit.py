"""Fitting DeltaKV's Down/Up per layer, and the checkpoint file that carries them.

Fitting: PCA of the codec's residuals (``deltakv_codec.residuals``) through their float64
Gram matrix, summed over calibration batches (:func:`residual_gram`,
:func:`fit_down_up_from_gram`) or from one batch (:func:`fit_down_up`); why that pair is
optimal, and the error bound it gives, is in ``deltakv_codec``'s docstring.

Checkpoint: ``{layer: (down, up)}`` in safetensors with the metadata the runtime checks
(:func:`save_checkpoint`, :func:`load_checkpoint`, written by ``deltakv_calibrate``), and
:func:`load_down_up`, which loads one for the running model and, where it does not fit,
names the knob to set or the calibration command to rerun.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sparseengine.config import ConfigError
from sparseengine.methods.deltakv_codec import _matrix_arg, center_stride
from sparseengine.methods.selection import _int_arg
from sparseengine.models.names import canonical

CHECKPOINT_FORMAT = "sparseengine-deltakv-v1"
_META_TYPES = {"model_name": str, "latent_dim": int, "center_ratio": float, "neighbors": int}


# ---------------------------------------------------------------------------- fitting


def residual_gram(res: torch.Tensor) -> torch.Tensor:
    """``R^T R`` in float64 ``[D, D]``; sum these over calibration batches."""
    _matrix_arg("residuals", res, "[N, D]")
    r64 = res.double()
    return r64.T @ r64


def fit_down_up_from_gram(gram: torch.Tensor, latent_dim: int):
    """Down/Up from an accumulated Gram matrix: its top-r eigenvectors are the top-r
    right singular vectors of the stacked residuals (see :func:`fit_down_up`)."""
    _matrix_arg("gram", gram, "[D, D]")
    dim = gram.shape[0]
    if gram.shape[1] != dim:
        raise ValueError(f"gram must be square [D, D], got {tuple(gram.shape)}")
    r = _int_arg("deltakv_latent_dim", latent_dim, minimum=1)
    if r > dim:
        raise ValueError(f"deltakv_latent_dim={r} exceeds the kv dim D={dim}")
    g = gram.double()
    _, vecs = torch.linalg.eigh((g + g.T) / 2)  # ascending eigenvalues
    down = vecs[:, -r:].flip(-1).float().contiguous()  # [D, r], largest first
    return down, down.T.contiguous()


def fit_down_up(residuals: torch.Tensor, latent_dim: int):
    """Fit ``Down [D, r]``, ``Up [r, D]`` (float32) minimising ``||R - R Down Up||_F``.

    PCA/SVD of the residuals is the optimal linear solution (Eckart-Young): with
    ``R = U S W^T``, ``Down = W_r`` (top-r right singular vectors) and ``Up = W_r^T``
    reach the minimum ``sum_{i>r} s_i^2`` (uncentred: the codec has no bias term).
    Computed from the float64 Gram ``R^T R``, which has the same eigenvectors.
    """
    return fit_down_up_from_gram(residual_gram(residuals), latent_dim)


# ------------------------------------------------------------------------- checkpoint


def save_checkpoint(path, layers: dict, meta: dict) -> None:
    """Write ``{layer: (down, up)}`` to safetensors with metadata ``model_name``,
    ``latent_dim``, ``center_ratio``, ``neighbors`` (other keys kept as strings)."""
    from safetensors.torch import save_file

    missing = [key for key in _META_TYPES if key not in meta]
    if missing:
        raise ValueError(f"checkpoint meta lacks {missing}; needs {list(_META_TYPES)}")
    if not layers:
        raise ValueError("layers is empty: nothing to save")
    r = _int_arg("latent_dim", meta["latent_dim"], minimum=1)
    tensors = {}
    for layer, pair in layers.items():
        layer = _int_arg("layer", layer)
        down, up = pair
        _matrix_arg(f"layer {layer} down", down, "[D, r]")
        _matrix_arg(f"layer {layer} up", up, "[r, D]")
        if down.shape[1] != r or tuple(up.shape) != (r, down.shape[0]):
            raise ValueError(
                f"layer {layer}: down {tuple(down.shape)} / up {tuple(up.shape)} do not "
                f"match latent_dim={r}"
            )
        tensors[f"layers.{layer}.down"] = down.detach().float().contiguous().cpu()
        tensors[f"layers.{layer}.up"] = up.detach().float().contiguous().cpu()
    text = {str(key): str(value) for key, value in meta.items()}
    text["format"] = CHECKPOINT_FORMAT
    save_file(tensors, str(path), metadata=text)


def load_checkpoint(path, device="cpu"):
    """``({layer: (down, up)}, meta)`` with ``latent_dim``/``neighbors`` as int and
    ``center_ratio`` as float."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=str(device)) as f:
        meta = dict(f.metadata() or {})
        names = list(f.keys())
        tensors = {name: f.get_tensor(name) for name in names}
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a DeltaKV checkpoint (format={meta.get('format')!r})")
    for key, kind in _META_TYPES.items():
        if key not in meta:
            raise ValueError(f"{path}: metadata lacks {key!r}")
        meta[key] = kind(meta[key])
    layers = {}
    for name in names:
        prefix, layer, part = name.split(".")
        if part == "down":
            layers[int(layer)] = (tensors[name], tensors[f"{prefix}.{layer}.up"])
    for layer, (down, up) in layers.items():
        if down.shape[1] != meta["latent_dim"]:
            raise ValueError(f"{path}: layer {layer} latent dim {down.shape[1]} != {meta['latent_dim']}")
    return dict(sorted(layers.items())), meta


# --------------------------------------------------------------------- runtime loading


def calibrate_hint(model_name: str) -> str:
    return (f"python -m sparseengine.methods.deltakv_calibrate --model {model_name} "
            f"--text FILE.txt --out deltakv_{model_name}.safetensors")


def load_down_up(path: str, model, sparse: list[int], *, ratio: float, stride: int, neighbors: int,
                 latent_dim: int, device):
    """``(down, up, meta)``: the checkpoint at ``path`` for the ``sparse`` layers of
    ``model``, cut to ``latent_dim``; a ConfigError where it is missing or was fitted for
    another model, center ratio (``stride``) or neighbour count."""
    name = model.name
    if not path:
        raise ConfigError(f"sparse_method=deltakv needs deltakv_checkpoint_path (Down/Up per layer, safetensors). "
                          f"Make one from any text with the calibration command: {calibrate_hint(name)}")
    if not Path(path).is_file():
        raise ConfigError(f"deltakv_checkpoint_path={path!r} does not exist. Make it with: {calibrate_hint(name)}")
    try:
        layers, meta = load_checkpoint(path, device)
    except Exception as e:  # noqa: BLE001 - any unreadable file is a config problem
        raise ConfigError(f"deltakv_checkpoint_path={path!r} is not a DeltaKV checkpoint ({e}). "
                          f"Make one with: {calibrate_hint(name)}") from None
    redo = f"recalibrate: {calibrate_hint(name)}"
    if canonical(meta["model_name"]) != canonical(name):
        raise ConfigError(f"deltakv_checkpoint_path={path!r} was fitted on model {meta['model_name']!r}, "
                          f"not {name!r}; {redo}")
    if center_stride(meta["center_ratio"]) != stride:
        raise ConfigError(f"deltakv_checkpoint_path={path!r} was fitted with deltakv_center_ratio="
                          f"{meta['center_ratio']}, the engine runs {ratio}; set it or {redo} "
                          f"--center-ratio {ratio}")
    if meta["neighbors"] != neighbors:
        raise ConfigError(f"deltakv_checkpoint_path={path!r} was fitted with deltakv_neighbors="
                          f"{meta['neighbors']}, the engine runs {neighbors}; set it or {redo} "
                          f"--neighbors {neighbors}")
    if latent_dim > meta["latent_dim"]:
        raise ConfigError(f"deltakv_latent_dim={latent_dim} exceeds the checkpoint's latent dim "
                          f"{meta['latent_dim']} ({path!r}); set deltakv_latent_dim<={meta['latent_dim']} "
                          f"or {redo} --latent-dim {latent_dim}")
    dim = 2 * model.num_kv_heads * model.head_dim
    missing = [layer for layer in sparse if layer not in layers]
    if missing:
        raise ConfigError(f"deltakv_checkpoint_path={path!r} has no Down/Up for sparse layers {missing}; {redo}")
    down, up = {}, {}
    for layer in sparse:
        d_, u_ = layers[layer]
        if d_.shape[0] != dim:
            raise ConfigError(f"deltakv_checkpoint_path={path!r}: layer {layer} Down is {tuple(d_.shape)}, "
                              f"the model's K|V dim is {dim}; {redo}")
        down[layer] = d_[:, :latent_dim].contiguous()
        up[layer] = u_[:latent_dim].contiguous()
    return down, up, meta
