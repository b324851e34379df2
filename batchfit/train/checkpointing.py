"""Activation checkpointing, the third memory lever (`trainer.activation_checkpointing`).

`blocks` wraps each block of the model so that its activations are not kept for the
backward pass but recomputed there (`torch.utils.checkpoint`, non-reentrant): about one more
forward pass of compute for the activations of all but one block at a time. Which modules
are blocks: the model's `checkpoint_blocks` attribute (a tuple of module types) if it has
one, else the residual blocks batchfit knows (torchvision's BasicBlock and Bottleneck, the
GPT's Block). A Hugging Face model (with or without peft adapters) checkpoints its decoder
layers itself: its `activation_checkpointing_enable` (`gradient_checkpointing_enable`
before transformers 5), non-reentrant. A model with none of them is refused, naming the
attribute to set.

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

    from batchfit.train.language.text import Block

    return (BasicBlock, Bottleneck, Block)


def apply(model: nn.Module, mode: str) -> int:
    """Wrap the model's blocks for `mode` in place; the number wrapped."""
    if mode == "none":
        return 0
    hf = _hugging_face_layers(model)
    if hf:
        return hf
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
            "batchfit knows (torchvision ResNet blocks, the GPT's Block, a Hugging Face "
            "model's layers); give the model a "
            "`checkpoint_blocks` attribute, a tuple of its block classes, or use "
            "trainer.activation_checkpointing=none"
        )
    return wrapped


def _hugging_face_layers(model: nn.Module) -> int:
    """Checkpoint a transformers model's layers (a peft model forwards the call to its
    base model); the number of layers checkpointed, 0 for any other model."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return 0
    enable = getattr(model, "activation_checkpointing_enable", None)
    enable = enable or getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        return 0
    enable({"use_reentrant": False})
    return len(hugging_face_checkpointed(model))


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks, as `apply` finds them (a checkpointed one with its wrapper): a
    transformers model's decoder layers, else modules of the model's `checkpoint_blocks`
    types or of the blocks batchfit knows. What FSDP shards as units
    (train/parallel/sharding.py)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers is optional (the `llm` extra)
        layers = []
    else:
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if layers:
        return layers
    types = tuple(getattr(model, "checkpoint_blocks", ())) or _known_blocks()
    found = []
    for module in model.modules():
        if (
            isinstance(module, Checkpointed)
            or isinstance(module, types)
            and not (found and _inside(found[-1], module))
        ):
            found.append(module)
    return found


def _inside(wrapper: nn.Module, module: nn.Module) -> bool:
    return isinstance(wrapper, Checkpointed) and wrapper.block is module


def hugging_face_checkpointed(model: nn.Module) -> list[nn.Module]:
    """The layers of a transformers model that recompute their activations."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [
        m
        for m in model.modules()
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    ]
