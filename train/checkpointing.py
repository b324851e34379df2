"""Activation checkpointing, the third memory lever (`trainer.activation_checkpointing`).

`blocks` wraps each block of the model so that its activations are not kept for the
backward pass but recomputed there (`torch.utils.checkpoint`, non-reentrant): about one more
forward pass of compute for the activations of all but one block at a time. Which modules
are blocks: the model's `checkpoint_blocks` attribute (a tuple of module types) if it has
one, else the residual blocks batchfit knows (torchvision's BasicBlock and Bottleneck, the
GPT's Block). A model with none of them is refused, naming the attribute to set.

BatchNorm layers inside a block see its forward twice, so their running statistics are
updated twice per step (as with any checkpointing of BatchNorm models); the gradients are
unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint


class Checkpointed(nn.Module):
    """A block whose activations are recomputed in the backward pass."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.training:
            return self.block(*args, **kwargs)
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def _known_blocks() -> tuple[type[nn.Module], ...]:
    from torchvision.models.resnet import BasicBlock, Bottleneck

    from train.text import Block

    return (BasicBlock, Bottleneck, Block)


def apply(model: nn.Module, mode: str) -> int:
    """Wrap the model's blocks for `mode` in place; the number wrapped."""
    if mode == "none":
        return 0
    types = tuple(getattr(model, "checkpoint_blocks", ())) or _known_blocks()
    wrapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, types) and not isinstance(parent, Checkpointed):
                setattr(parent, name, Checkpointed(child))
                wrapped += 1
    if not wrapped:
        raise ValueError(
            f"trainer.activation_checkpointing={mode}: {type(model).__name__} has no block "
            "batchfit knows (torchvision ResNet blocks, the GPT's Block); give the model a "
            "`checkpoint_blocks` attribute, a tuple of its block classes, or use "
            "trainer.activation_checkpointing=none"
        )
    return wrapped
