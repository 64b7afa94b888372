"""`python -m minivllm ...` is the `minivllm` command."""

import sys

from .cli import main

sys.exit(main())
