import sys

from voice_trainers.cli import main

sys.exit(main())
