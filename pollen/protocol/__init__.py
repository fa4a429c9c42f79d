"""The wire contract between Pollen's strategies and any client: record names, shapes, dtypes.

One module per family (:mod:`~pollen.protocol.weights`, :mod:`~pollen.protocol.prototypes`,
:mod:`~pollen.protocol.logits`, :mod:`~pollen.protocol.glfc`) holds the keys and the encode/decode
helpers *both* sides use, so a client written in another project needs no knowledge of order or
dtype. numpy only: nothing here imports torch or the rest of Pollen.
"""

from pollen.protocol.logits import decode_consensus, encode_logit_reply, public_fingerprint  # noqa: F401
from pollen.protocol.prototypes import decode_global_prototypes, encode_prototype_reply  # noqa: F401
from pollen.protocol.records import ARRAYS, CONFIG, METRICS, NUM_EXAMPLES, reply_content  # noqa: F401
from pollen.protocol.weights import encode_weights_reply  # noqa: F401
