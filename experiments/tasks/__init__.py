"""Tasks: each a Hydra ``task`` option (``_target_`` one of these dataclasses) with ``run(env)``."""
