"""The launcher's former module (``python -m pollen.app.launch``); it lives in :mod:`pollen.launch` now.

Kept one release and only for that spelling: running it prints the new one (``pollen run``). The app
layer never imports the launcher; this file is the one exception the layering test names.
"""

import sys

if __name__ == "__main__":
    from pollen.launch import launcher

    print("note: `python -m pollen.app.launch` is now `pollen run`; this spelling goes in the next release",
          file=sys.stderr)
    sys.exit(launcher.main())
