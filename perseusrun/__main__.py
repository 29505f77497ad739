"""`python -m perseusrun`: the perseusrun command."""

import sys

from perseusrun.launch import main

sys.exit(main())
