"""`python -m iteration iterate --config FILE [key=value ...]`."""

import sys

from igrpo import main

sys.exit(main(stages=("iterate",)))
