import sys

from worker.ops.cli import main

sys.exit(main())
