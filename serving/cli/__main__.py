"""`python -m serving.cli`: the same as the `pathserve` command."""

import sys

from serving.cli.main import main

sys.exit(main())
