"""python -m repro.reproduction.report (also python -m repro.report)."""
import sys

from repro.reproduction.report.build import main

sys.exit(main())
