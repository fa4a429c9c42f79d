"""The `pollen` command's former module; it lives in :mod:`pollen.launch.cli` now.

Kept one release so that console scripts installed before the move and ``python -m pollen.cli`` still
work: importing this module gives the new one.
"""

import sys

from pollen.launch import cli as _cli

if __name__ == "__main__":
    sys.exit(_cli.main())
else:
    sys.modules[__name__] = _cli
