"""`python -m reward_model {train-rm,eval-rm} --config FILE [key=value ...]`."""

import sys

from igrpo import main

sys.exit(main(stages=("train-rm", "eval-rm")))
