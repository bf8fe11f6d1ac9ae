"""python -m hflax.metrics plot RUN_DIR [--out file.png] [--keys KEY ...]"""
import sys

from hflax.metrics.plot import main

sys.exit(main())
