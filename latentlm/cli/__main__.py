"""`python -m latentlm.cli ...` runs the command line."""

import sys

from latentlm.cli import main

sys.exit(main())
