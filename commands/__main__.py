"""`python -m commands ...` is `pdserve ...`."""

import sys

from commands.main import main

sys.exit(main())
