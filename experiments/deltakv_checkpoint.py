"""DeltaKV's calibrated Down/Up for a sweep that names none: ``deltakv_checkpoint=auto``.

DeltaKV needs a checkpoint fitted on the model's own KV (``sparseengine.methods.
deltakv_calibrate``). With ``auto`` (the toolkit's default) a job fits one the first time it
needs it, on the offline corpus (the module docstrings of Python's standard library,
`experiments.corpus`; seeded random token ids for a model without a tokenizer, such as the
dummy-weight benchmark shapes), and keeps it in ``deltakv_cache_dir`` under a name made of
everything the fit depends on (model, weights, device type, dtype, latent dim, center ratio,
neighbours, corpus and its token count), so later jobs and sweeps reuse it. Jobs running
at once wait on a lock file for the one that fits it. The job's record names the file it
used (``engine.deltakv_checkpoint_path``), and the file's metadata says what it was fitted
on. A path given instead is used as given; an empty one is the engine's error.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
from pathlib import Path
from typing import Any

from experiments.corpus import STDLIB_CORPUS, stdlib_docstrings

AUTO = "auto"
CORPUS_CHARS_PER_TOKEN = 6  # characters of docstrings taken per token wanted (English text: ~4)


def wanted(engine: dict[str, Any]) -> bool:
    """Whether ``engine`` (LLM keywords) asks for the automatic checkpoint: its knob (which only
    DeltaKV's YAML sets, conf/sparse_method/deltakv.yaml) is ``auto``."""
    return engine.get("deltakv_checkpoint_path") == AUTO


def resolve(engine: dict[str, Any], cache_dir: str | Path, tokens: int = 8192) -> dict[str, Any]:
    """``engine`` with an ``auto`` DeltaKV checkpoint replaced by the cached file's path
    (fitted first when missing, on ``tokens`` tokens); other engines as given."""
    if not wanted(engine):
        return engine
    if int(tokens) < 1:
        raise ValueError(f"deltakv_auto_tokens must be a positive number of tokens, got {tokens!r}")
    from sparseengine.config import resolve_device

    device = resolve_device(str(engine.get("device", "auto"))).type  # a CPU fit and a GPU fit keep apart
    knobs = {"model": str(engine.get("model")), "load_format": str(engine.get("load_format", "auto")),
             "device": device, "dtype": str(engine.get("dtype", "auto")),
             "latent_dim": int(engine.get("deltakv_latent_dim", 256)),
             "center_ratio": float(engine.get("deltakv_center_ratio", 0.1)),
             "neighbors": int(engine.get("deltakv_neighbors", 4)), "tokens": int(tokens)}
    path = Path(cache_dir) / f"{_name(knobs)}.safetensors"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another job may be fitting it: wait, then find it there
            if not path.exists():
                _fit(knobs, path)
    return {**engine, "deltakv_checkpoint_path": str(path)}


def _name(knobs: dict[str, Any]) -> str:
    model = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(knobs["model"]).name or knobs["model"])
    digest = hashlib.sha1(repr(sorted(knobs.items())).encode()).hexdigest()[:10]
    return (f"deltakv_{model}_{knobs['load_format']}_{knobs['device']}_{knobs['dtype']}_r{knobs['latent_dim']}_"
            f"c{knobs['center_ratio']:g}_n{knobs['neighbors']}_{knobs['tokens']}tok_{digest}")


def _fit(knobs: dict[str, Any], path: Path) -> None:
    """Fit on the corpus and write ``path`` (through a temporary file, so a reader never sees
    half of one)."""
    from sparseengine.methods.deltakv_calibrate import calibrate, random_tokens
    from sparseengine.models.loader import resolve as resolve_model

    if knobs["load_format"] == "dummy" or resolve_model(knobs["model"], knobs["load_format"]).folder is None:
        corpus = random_tokens(knobs["model"], knobs["load_format"], knobs["tokens"])  # random weights, no tokenizer
    else:
        corpus = dict(text=stdlib_docstrings(CORPUS_CHARS_PER_TOKEN * knobs["tokens"]), sources=STDLIB_CORPUS)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        calibrate(knobs["model"], out=tmp, latent_dim=knobs["latent_dim"], center_ratio=knobs["center_ratio"],
                  neighbors=knobs["neighbors"], max_tokens=knobs["tokens"], load_format=knobs["load_format"],
                  dtype=knobs["dtype"], device=knobs["device"], progress=False, **corpus)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
