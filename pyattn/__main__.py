"""``python -m pyattn``: the self-check report (see pyattn.selfcheck). Exits 1 if any check
fails."""
import sys

from .selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
