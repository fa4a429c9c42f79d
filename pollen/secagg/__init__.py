"""SecAgg+ on Flower's Message API: the server learns the sum of the clients' replies, never one of them.

* :class:`SecAggPlus` (server): runs a round's four stages over any ``Grid`` from a ServerApp or a
  strategy and returns the sum (:class:`SecureSum`); parameters in :class:`SecAggConfig`.
* :func:`secagg_mod` (client): ``ClientApp(mods=[secagg_mod])`` answers the stages and masks what the
  app's own ``train`` handler replies.
* :mod:`pollen.secagg.payloads`: what each payload kind (weights, prototypes, logits) adds to the sum
  and how the sum becomes the aggregate; :mod:`pollen.protocol.secagg`: the stage records.

numpy, Flower's ``secure_aggregation`` primitives and ``cryptography`` only: no torch.
"""

from pollen.secagg.client import secagg_mod
from pollen.secagg.payloads import mean_of_sums
from pollen.secagg.server import SecAggConfig, SecAggFailed, SecAggPlus, SecureSum

__all__ = ["SecAggConfig", "SecAggFailed", "SecAggPlus", "SecureSum", "mean_of_sums", "secagg_mod"]
