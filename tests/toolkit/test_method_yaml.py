"""The method YAMLs and the registry agree: one file per registered method, no file for an
unknown one, and each file holds its method's knobs (and any it shares) at the registry's defaults."""

from __future__ import annotations

import pytest
import yaml

from experiments.deltakv_checkpoint import AUTO
from sparseengine import method_registry as registry
from tests.toolkit.conftest import CONF

AXES = [("sparse_method", "decode", registry.decode_methods), ("prefill_sparse_method", "prefill",
                                                                registry.prefill_methods)]


@pytest.mark.parametrize("group,kind,names", AXES, ids=[a[0] for a in AXES])
def test_one_yaml_per_registered_method(group, kind, names) -> None:
    on_disk = {p.stem for p in (CONF / group).glob("*.yaml")}
    missing = sorted(set(names()) - on_disk)
    unknown = sorted(on_disk - set(names()))
    assert not missing, (f"registered {group} without conf/{group}/<name>.yaml: {missing}; write them with "
                         f"python -m experiments.method_yaml {' '.join(missing)}")
    assert not unknown, f"conf/{group} has files for unregistered methods: {unknown}; valid: {names()}"


@pytest.mark.parametrize("group,kind,path", [(g, k, p) for g, k, _ in AXES for p in sorted((CONF / g).glob("*.yaml"))],
                         ids=lambda x: getattr(x, "stem", str(x)))
def test_yaml_knobs_are_registry_defaults(group, kind, path) -> None:
    data = yaml.safe_load(path.read_text()) or {}
    spec = registry.get_spec(data.get(group), kind)
    assert data[group] == path.stem
    knobs = {k: v for k, v in data.items() if k != group}
    defaults = registry.all_knob_defaults()  # a method may also set knobs it shares with another
    assert set(spec.knobs) <= set(knobs), f"{path.name} lacks its knobs {sorted(set(spec.knobs) - set(knobs))}"
    top = yaml.safe_load((CONF / "config.yaml").read_text())
    for key, value in knobs.items():
        assert key in defaults, f"{path.name}: {key!r} is no registry hyperparameter; valid: {sorted(defaults)}"
        if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
            value = top[value[2:-1]]  # a top-level option a sweep sets once (e.g. deltakv_checkpoint)
            if key == "deltakv_checkpoint_path" and value == AUTO:
                continue  # the toolkit's default, replaced before the engine sees it (deltakv_checkpoint.py)
        assert value == defaults[key], f"{path.name}: {key}={value!r}, the registry default is {defaults[key]!r}"
