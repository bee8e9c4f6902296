"""``deltakv_checkpoint=auto``: a DeltaKV job that names no checkpoint gets one fitted on the
offline corpus, once, kept in the cache under a name of what the fit depends on, and named
in the job's record; other engines and given paths pass through untouched."""

from __future__ import annotations

import json

import pytest

from experiments import deltakv_checkpoint
from experiments.corpus import STDLIB_CORPUS
from experiments.job import run_job
from experiments.records import read_records
from tests.toolkit.conftest import compose

TINY = {"model": "tiny-llama", "load_format": "dummy", "dtype": "float32", "device": "cpu", "sparse_method": "deltakv",
        "deltakv_checkpoint_path": "auto", "deltakv_latent_dim": 32}


def _meta(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_fitted_once_then_reused(tmp_path) -> None:
    engine = deltakv_checkpoint.resolve(dict(TINY), tmp_path, tokens=600)
    path = tmp_path / engine.pop("deltakv_checkpoint_path").split("/")[-1]
    assert engine == {k: v for k, v in TINY.items() if k != "deltakv_checkpoint_path"}
    assert path.exists() and "tiny-llama" in path.name and "r32" in path.name and "600tok" in path.name
    meta = _meta(path)
    assert meta["sources"].startswith("random token ids") and meta["latent_dim"] == "32"
    stamp = path.stat().st_mtime_ns
    again = deltakv_checkpoint.resolve(dict(TINY), tmp_path, tokens=600)
    assert again["deltakv_checkpoint_path"] == str(path) and path.stat().st_mtime_ns == stamp
    other = deltakv_checkpoint.resolve({**TINY, "deltakv_latent_dim": 16}, tmp_path, tokens=600)
    assert other["deltakv_checkpoint_path"] != str(path)  # another fit for another shape
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".lock", ".lock", ".safetensors", ".safetensors"]


def test_a_model_with_a_tokenizer_fits_on_the_stdlib_corpus(tmp_path) -> None:
    engine = {"model": "smollm2-135m-instruct", "device": "cpu", "sparse_method": "deltakv",
              "deltakv_checkpoint_path": "auto"}
    path = deltakv_checkpoint.resolve(engine, tmp_path, tokens=700)["deltakv_checkpoint_path"]
    meta = _meta(path)
    assert meta["sources"] == STDLIB_CORPUS and meta["model_name"] == "smollm2-135m-instruct"
    assert 200 < int(meta["tokens"]) <= 700


def test_other_engines_and_given_paths_pass_through(tmp_path) -> None:
    quest = {k: v for k, v in TINY.items() if not k.startswith("deltakv")} | {"sparse_method": "quest"}
    for engine in (quest, {**TINY, "deltakv_checkpoint_path": "/some/file.safetensors"},
                   {**TINY, "deltakv_checkpoint_path": ""}):
        assert deltakv_checkpoint.resolve(dict(engine), tmp_path) == engine
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="deltakv_auto_tokens must be a positive number of tokens, got 0"):
        deltakv_checkpoint.resolve(dict(TINY), tmp_path, tokens=0)


def test_a_job_records_the_fitted_file(tmp_path) -> None:
    """A deltakv job with the toolkit's default (auto) runs, and its record names the file."""
    cfg = compose(["debug=tiny", "sparse_method=deltakv", f"records_path={tmp_path / 'r.jsonl'}",
                   f"deltakv_cache_dir={tmp_path / 'cache'}", "deltakv_auto_tokens=600",
                   "engine.deltakv_latent_dim=32", "engine.deltakv_full_layers='1,2'"])
    assert cfg.deltakv_checkpoint == "auto"
    run_job(cfg)
    (rec,) = read_records(tmp_path / "r.jsonl")
    assert rec["status"] == "ok", rec.get("error")
    path = rec["engine"]["deltakv_checkpoint_path"]
    assert path.startswith(str(tmp_path / "cache")) and json.loads(_meta(path)["energy_kept"])
