"""``python -m ckpt_engine``: the ``ckpt-engine`` command line."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
