"""`python -m policy {sft,grpo,eval} --config FILE [key=value ...]`."""

import sys

from igrpo import main

sys.exit(main(stages=("sft", "grpo", "eval")))
