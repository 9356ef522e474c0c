"""`python -m pdserve ...` is `pdserve ...`."""

import sys

from pdserve.main import main

sys.exit(main())
