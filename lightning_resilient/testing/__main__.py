"""``python -m lightning_resilient.testing UPSTREAM [--latency S] [--bandwidth B] [--fail-rate F]``: the proxy."""

import sys

from lightning_resilient.testing.proxy import main

sys.exit(main())
