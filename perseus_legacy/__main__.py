"""`python -m perseus_legacy`: what this installation has (perseus_legacy.diagnostics)."""

import sys

from perseus_legacy.diagnostics import main

if __name__ == "__main__":
    sys.exit(main())
