"""`python -m process_supervision label --config FILE [key=value ...]`."""

import sys

from igrpo import main

sys.exit(main(stages=("label",)))
