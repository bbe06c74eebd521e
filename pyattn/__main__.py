"""``python -m pyattn [check] [options]``: the self-check report (see pyattn.selfcheck; the
default command). ``python -m pyattn --help`` lists the commands and options. Exits 1 if any
check fails, 2 on a bad command line."""
import sys

from .selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
