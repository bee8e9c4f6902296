"""The single entrypoint of the toolkit.

    python run.py                                   # the default experiment (SmolLM2, CPU)
    python run.py task=ruler context=2k             # any option of any config group
    python run.py -m sparse_method=vanilla seed=0,1 # a sweep: one record per job
    python run.py experiment=decode_throughput_128k # a paper figure's experiment
"""

import hydra
from omegaconf import DictConfig

from experiments.resolvers import register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from experiments.job import run_job

    return run_job(cfg)


if __name__ == "__main__":
    main()
