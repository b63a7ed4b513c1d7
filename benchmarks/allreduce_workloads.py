"""Gradient shape lists for benchmarks/allreduce.py: ResNet-50 (161 tensors) and 1,000 small tensors."""

from __future__ import annotations

__all__ = ["resnet50_shapes", "small_shapes", "RESNET50_TENSORS", "RESNET50_VALUES"]

RESNET50_TENSORS = 161
RESNET50_VALUES = 25_557_032


def resnet50_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's ResNet-50, built from the architecture (not hard-coded)."""
    shapes: list[tuple[int, ...]] = []

    def conv_bn(cin: int, cout: int, k: int) -> None:
        shapes.append((cout, cin, k, k))
        shapes.extend([(cout,), (cout,)])            # BN weight and bias

    conv_bn(3, 64, 7)
    cin, expansion = 64, 4
    for blocks, planes in zip((3, 4, 6, 3), (64, 128, 256, 512)):
        for b in range(blocks):
            conv_bn(cin, planes, 1)
            conv_bn(planes, planes, 3)
            conv_bn(planes, planes * expansion, 1)
            if b == 0:
                conv_bn(cin, planes * expansion, 1)  # downsample
            cin = planes * expansion
    shapes.append((1000, 2048))
    shapes.append((1000,))
    return shapes


def small_shapes(count: int = 1000, size: int = 256) -> list[tuple[int, ...]]:
    """Workload B: ``count`` tensors of ``size`` float32 values."""
    return [(size,)] * count
