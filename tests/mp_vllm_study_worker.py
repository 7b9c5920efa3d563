"""Worker of tests/test_vllm.py's two-process study test, run by torchrun with 2 CPU processes (gloo): the study of
<folder>/study.yaml with use_vllm (colocate); the error each process gets in <folder>/error-rank<r>.txt."""

import os
import sys

import yaml

from gfpo_study import study
from gfpo_study.config import ConfigError
from gfpo_test_utils import end_worker_process


def main(folder):
    with open(os.path.join(folder, "study.yaml")) as f:
        config = study.study_config(yaml.safe_load(f), folder)
    try:
        study.run_study(config)
        error = ""
    except ConfigError as refused:
        error = str(refused)
    with open(os.path.join(folder, f"error-rank{os.environ['RANK']}.txt"), "w") as f:
        f.write(error)


if __name__ == "__main__":
    main(sys.argv[1])
    end_worker_process()
