"""``python -m zllm``: the CLI, so that ``torchrun --nproc-per-node N -m zllm serve --config x.yaml`` starts a job."""

import sys

from zllm.cli.main import main

sys.exit(main())
