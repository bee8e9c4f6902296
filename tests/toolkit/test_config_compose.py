"""Every option of every config group composes into a valid engine Config and task;
every experiment composes; every option file names what it is for."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from sparseengine import Config
from sparseengine import method_registry as registry
from tests.toolkit.conftest import CONF, GROUPS, compose, options

CASES = [(g, o) for g in GROUPS for o in options(g)]


def _method_for_policy(policy: str) -> str | None:
    if policy == "auto":
        return "vanilla"
    fits = [m for m in registry.decode_methods() if registry.get_spec(m).prefill_policy == policy]
    with_yaml = [m for m in fits if (CONF / "sparse_method" / f"{m}.yaml").exists()]
    return (with_yaml or fits or [None])[0]


@pytest.mark.parametrize("group,option", CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_option_composes(group: str, option: str) -> None:
    overrides = [f"{group}={option}"]
    if group == "prefill_policy":
        method = _method_for_policy(option)
        if method is None:
            pytest.skip(f"no registered method defaults to prefill_policy={option}")
        if (CONF / "sparse_method" / f"{method}.yaml").exists():
            overrides.append(f"sparse_method={method}")
        else:
            pytest.skip(f"conf/sparse_method/{method}.yaml is missing (see test_method_yaml)")
    cfg = compose(overrides)
    engine = OmegaConf.to_container(cfg.engine, resolve=True)
    Config.from_kwargs(**engine)  # every key is a Config field or registry knob, every value valid
    task = instantiate(cfg.task, _convert_="all")
    assert task.name == cfg.task.name
    assert (CONF / group / f"{option}.yaml").read_text().lstrip().startswith("#"), "start with a one-line comment"


@pytest.mark.parametrize("option", options("hydra/launcher"))
def test_launcher_composes(option: str) -> None:
    cfg = compose([f"hydra/launcher={option}"], return_hydra_config=True)
    assert "_target_" in cfg.hydra.launcher


@pytest.mark.parametrize("experiment", options("experiment"))
def test_experiment_composes(experiment: str) -> None:
    text = (CONF / "experiment" / f"{experiment}.yaml").read_text()
    assert "python run.py" in text.splitlines()[1], "line 2 is the one-line usage comment"
    cfg = compose([f"experiment={experiment}"], return_hydra_config=True)
    Config.from_kwargs(**OmegaConf.to_container(cfg.engine, resolve=True))
    instantiate(cfg.task, _convert_="all")
    for key, value in (cfg.hydra.sweeper.params or {}).items():
        assert str(value), f"sweep axis {key} resolves to something"
    # Hydra instantiates callbacks when a multirun starts, before HydraConfig is set: they
    # must not read ${hydra:...} (that failed on the GPU machine before this test existed)
    for name, params in (cfg.hydra.callbacks or {}).items():
        instantiate(params, _convert_="all")


def test_default_config_is_the_embedded_model_on_cpu_friendly_settings() -> None:
    cfg = compose([])
    assert cfg.engine.model == "smollm2-135m-instruct"
    assert cfg.task.name == "passkey"


def test_qwen3_headline_is_the_llama_protocol_on_its_own_shape_and_files() -> None:
    llama = compose(["experiment=decode_throughput_128k"], return_hydra_config=True)
    qwen = compose(["experiment=decode_throughput_128k_qwen3"], return_hydra_config=True)
    assert (llama.engine.model, qwen.engine.model) == ("llama-3.1-8b", "qwen3-8b")
    assert OmegaConf.to_container(qwen.task) == OmegaConf.to_container(llama.task)
    assert qwen.total_budget == llama.total_budget == 2048
    assert qwen.records_path != llama.records_path
    summary = qwen.hydra.callbacks.summary
    assert summary.csv_name == "decode_throughput_128k_qwen3.csv"
    assert list(summary.figures) == ["decode_throughput:decode_throughput_128k_qwen3"]


def test_ragged_experiment_is_the_headline_protocol_over_mixes_and_split_plans() -> None:
    import ast

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from experiments.throughput.length_mix import LengthMix

    llama = compose(["experiment=decode_throughput_128k"])
    ragged = compose(["experiment=decode_throughput_ragged"], return_hydra_config=True)
    assert ragged.engine.model == llama.engine.model and ragged.engine.max_model_len == llama.engine.max_model_len
    for key in ("output_len", "warmup_steps", "timed_steps", "prefill", "context_length"):
        assert ragged.task[key] == llama.task[key], key
    assert list(ragged.task.hf_batches) == [] and ragged.records_path != llama.records_path
    params = ragged.hydra.sweeper.params
    parse = OverridesParser.create().parse_override
    assert list(parse(f"engine.decode_split_plan={params['engine.decode_split_plan']}").sweep_string_iterator()) \
        == ["auto", "per_row"]
    mixes = list(parse(f"task.length_mix={params['task.length_mix']}").sweep_string_iterator())
    assert [LengthMix.parse(ast.literal_eval(m), 0).label() for m in mixes] == ["131072x1+4096x15", "131072x1+1024x63"]
    assert ragged.hydra.callbacks.summary.csv_name == "decode_throughput_ragged.csv"
