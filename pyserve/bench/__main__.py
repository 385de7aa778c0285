"""`python -m pyserve.bench {serve,offline,one-batch} ...`"""

import sys

from pyserve.bench.cli import main

sys.exit(main(prog="python -m pyserve.bench"))
