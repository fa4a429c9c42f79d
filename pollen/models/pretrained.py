"""Loading a local ImageNet ResNet state dict into Pollen's CIFAR ResNets (FedProto's CIFAR-10 setup).

FedProto's official code starts its CIFAR-10 ResNet-18 from ImageNet weights for every layer except the
stem (``conv1``/``bn1``) and the classifier (``fc``), and reports that this matters. Nothing is
downloaded at run time here: the user points a run key at a file they already have (e.g. torchvision's
``resnet18-f37072fd.pth``). Pollen's ResNets use torchvision's module names, so the stage weights load
by name; every key is checked for presence and shape before anything is copied.
"""

from __future__ import annotations

from pathlib import Path

import torch

# FedProto keeps these from the fresh model: the CIFAR stem differs (3×3, stride 1) and the head is new.
SKIPPED_PREFIXES = ("conv1.", "bn1.", "fc.", "head.")


class PretrainedWeightsError(ValueError):
    """The weights file is missing, unreadable, or does not fit the model."""


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise PretrainedWeightsError(
            f"pretrained weights file {str(path)!r} does not exist; download an ImageNet ResNet state dict "
            "(e.g. torchvision's resnet18-f37072fd.pth) on a machine with internet and copy it there")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for corrupt / non-tensor files
        raise PretrainedWeightsError(f"cannot read pretrained weights {str(path)!r}: {err}") from err
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise PretrainedWeightsError(f"{str(path)!r} is not a state dict of tensors")
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}


def load_stage_weights(model: torch.nn.Module, path: str | Path) -> int:
    """Copy every weight of ``path`` except the stem and classifier into ``model``; returns how many.

    Raises :class:`PretrainedWeightsError` when a key has no counterpart in the model or a different
    shape (e.g. a ResNet-34 file for a ResNet-18, or ``model-width`` ≠ 1), so a mismatch never loads
    silently half-way.
    """
    source = _read_state_dict(Path(path).expanduser())
    target = model.state_dict()
    wanted = {k: v for k, v in source.items() if not k.startswith(SKIPPED_PREFIXES)}
    missing = sorted(k for k in wanted if k not in target)
    wrong = sorted(k for k in wanted if k in target and tuple(target[k].shape) != tuple(wanted[k].shape))
    if missing or wrong or not wanted:
        detail = []
        if missing:
            detail.append(f"{len(missing)} keys the model lacks (first: {', '.join(missing[:3])})")
        if wrong:
            k = wrong[0]
            detail.append(f"{len(wrong)} shape mismatches (first: {k} {tuple(wanted[k].shape)} in the file, "
                          f"{tuple(target[k].shape)} in the model)")
        if not wanted:
            detail.append("no weights outside conv1/bn1/fc")
        raise PretrainedWeightsError(
            f"pretrained weights {str(path)!r} do not fit {type(model).__name__}: " + "; ".join(detail)
            + " — use the ResNet depth the file was made for and model-width = 1")
    with torch.no_grad():
        for k, v in wanted.items():
            target[k].copy_(v.to(target[k].dtype))
    return len(wanted)
