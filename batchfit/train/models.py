"""Model builders. Each takes its own keyword arguments from `conf/model/*.yaml`, plus what it
asks for by name of the data's `info` (`num_classes`, `in_channels`, `vocab_size`: see
train/data.py); a user's model plugs in the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torchvision import models

if TYPE_CHECKING:
    from batchfit.train.tasks import Task


def _cifar_stem(net: models.ResNet, in_channels: int) -> models.ResNet:
    # Small images (32x32 and below): a 3x3 stride-1 stem and no max-pool, so layer1 sees the
    # full resolution instead of a quarter of it (He et al. 2016, section 4.2).
    net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


def resnet18(num_classes: int, in_channels: int = 3) -> nn.Module:
    """ResNet-18 with the CIFAR stem."""
    return _cifar_stem(models.resnet18(num_classes=num_classes), in_channels)


def resnet50(num_classes: int, in_channels: int = 3) -> nn.Module:
    """ResNet-50 with the CIFAR stem."""
    return _cifar_stem(models.resnet50(num_classes=num_classes), in_channels)


def small_cnn(num_classes: int, in_channels: int = 3, width: int = 32) -> nn.Module:
    """Two conv blocks and a linear head: seconds to train, for tests and quick studies."""
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),  # (N, 2w, H, W) -> (N, 2w, 1, 1)
        nn.Flatten(),
        nn.Linear(2 * width, num_classes),
    )


def mlp(num_classes: int, in_channels: int = 3, hidden: int = 256, depth: int = 2) -> nn.Module:
    """A multi-layer perceptron over flattened images (input size inferred on first call)."""
    layers: list[nn.Module] = [nn.Flatten()]
    for _ in range(depth):
        layers += [nn.LazyLinear(hidden), nn.ReLU(inplace=True)]
    layers.append(nn.Linear(hidden, num_classes))
    return nn.Sequential(*layers)


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def materialize(model: nn.Module, task: Task, example: Any) -> None:
    """Run one forward pass of an example batch so lazy modules get their shapes before the
    optimizer is built."""
    if any(isinstance(m, nn.modules.lazy.LazyModuleMixin) for m in model.modules()):
        with torch.no_grad():
            task.forward(model, example)
