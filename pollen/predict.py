"""``pollen predict``'s former module (``python -m pollen.predict``); it lives in :mod:`pollen.launch.predict`.

Kept one release: running it prints the new spelling, importing it gives the new module.
"""

import sys

from pollen.launch import predict as _predict

if __name__ == "__main__":
    print("note: `python -m pollen.predict` is now `pollen predict`; this spelling goes in the next release",
          file=sys.stderr)
    sys.exit(_predict.main())
else:
    sys.modules[__name__] = _predict
