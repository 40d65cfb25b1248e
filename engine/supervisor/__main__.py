"""`python -m engine.supervisor --run-dir D`: the supervisor process (engine.supervisor.main)."""
import sys

from engine.supervisor.main import main

sys.exit(main())
