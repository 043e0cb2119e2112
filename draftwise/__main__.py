"""`python -m draftwise ...` runs the command line."""
import sys

from draftwise.cli import main

sys.exit(main())
