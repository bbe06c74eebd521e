"""``python -m pyattn [COMMAND] [options]``: ``check``, the self-check report (see
pyattn.selfcheck; the default command), ``train`` and ``generate`` (see pyattn.training).
``python -m pyattn --help`` lists the commands, ``python -m pyattn COMMAND --help`` their
options. Every command exits 2 on a bad command line; ``check`` exits 1 if any check fails,
``train`` 1 if its loss is not finite (nothing saved) and 130 on Ctrl-C."""
import sys

from .selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
