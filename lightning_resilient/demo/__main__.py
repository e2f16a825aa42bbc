import sys

from lightning_resilient.demo import main

sys.exit(main())
