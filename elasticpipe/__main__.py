"""``python -m elasticpipe``: the same as the ``elasticpipe`` command."""

import sys

from elasticpipe.cli.entry import main

sys.exit(main())
