import sys

from engine.simulator.cli import main

sys.exit(main())
