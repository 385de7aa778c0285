"""`python -m pyserve serve ...`"""

import sys

from pyserve.cli import main

sys.exit(main())
