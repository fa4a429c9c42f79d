"""The prototype family's run keys and facts the server reads, without torch.

:class:`ProtoSettings` declares the ``proto-…`` keys; :func:`heterogeneous_channels` says which CNN each
client of FedProto's model-heterogeneous setting builds. The registry and the ServerApp read these, and
importing :mod:`pollen.methods.prototypes` (the round: torch) for them would make the launcher and the
numpy-only prototype ServerApp pay torch's import (issue 30: start-up cost).
"""

from __future__ import annotations

from dataclasses import dataclass

from pollen.protocol.prototypes import PROTO_WEIGHTINGS
from pollen.settings import setting

LOCAL_PROTO_MODES = ("post-pass", "training")
NEGATIVE_FORMS = ("hinge", "infonce")
# context.state key of a client's private model (its personal model, saved at the end of a run).
MODEL_KEY = "proto-model"


@dataclass(frozen=True)
class ProtoSettings:
    """The prototype family's run keys (``proto-…``), each declared once: default, range, help."""

    lam: float = setting("proto-lambda", 1.0, "float > 0",
                         "λ (λ_0 for BD-FedProto): weight of the prototype loss L_P")
    beta: float = setting("proto-beta", 0.5, "float >= 0", "β: weight of CPA's negative loss L_N (BD-FedProto)")
    cpa: bool = setting("proto-cpa", True, "bool",
                        "BD-FedProto: use CPA's negatives (the global prototypes of classes the client lacks)")
    da: bool = setting("proto-da", True, "bool", "BD-FedProto: adapt λ_D each round (DA); false = fixed λ")
    da_alpha: float = setting("proto-da-alpha", 0.5, "float in [0, 1]", "DA smoothing α of λ_D")
    da_t0: float = setting("proto-da-t0", 2.0, "float > 0", "DA annealing temperature T_0")
    da_kappa: float = setting("proto-da-kappa", 0.95, "float in (0, 1]", "DA temperature decay κ per round")
    da_tmin: float = setting("proto-da-tmin", 0.05, "float > 0", "DA minimum temperature")
    negative: str = setting("proto-negative", "hinge", "choice",
                            "form of CPA's negative loss: margin hinge or InfoNCE", choices=NEGATIVE_FORMS)
    tau: float = setting("proto-tau", 0.5, "float > 0",
                         "temperature of the InfoNCE negatives and of the MI monitor")
    weighting: str = setting("proto-weighting", "samples", "choice",
                             "server average per class: by class counts, or `uniform` (the official code)",
                             choices=PROTO_WEIGHTINGS)
    local_protos: str = setting("proto-local-protos", "post-pass", "choice",
                                "local prototypes from a pass after training, or training-time features "
                                "(the official code)", choices=LOCAL_PROTO_MODES)
    model_heter: bool = setting("proto-model-heter", False, "bool",
                                "FedProto's model-heterogeneous CNNs (18/20/22 channels by client)")
    evaluate_every: int = setting("proto-evaluate-every", 1, "int >= 1", "evaluate every N rounds (and in the last)")
    pretrained: str = setting("proto-pretrained", "", "path",
                              "local ImageNet ResNet-18/34 state dict loaded into every client "
                              "(all but conv1/bn1/fc); empty = none")


def heterogeneous_channels(partition_id: int) -> int:
    """FedProto's model-heterogeneous MNIST: conv2 width 18 / 20 / 22 for clients 0-6 / 7-13 / 14+."""
    return 18 if partition_id < 7 else 20 if partition_id < 14 else 22
