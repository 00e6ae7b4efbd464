"""ResNet-50 of torch_autopar.testing.resnet: torchvision's parameter count, output shapes, deterministic init."""

import torch

from torch_autopar.testing.resnet import RESNET50_PARAMETERS, ResNet50


def test_parameter_count_is_torchvision_resnet50():
    with torch.device("meta"):
        model = ResNet50()
    assert sum(p.numel() for p in model.parameters()) == RESNET50_PARAMETERS == 25_557_032


def test_forward_shape_on_meta_224():
    with torch.device("meta"):
        model = ResNet50()
        logits = model(torch.empty(2, 3, 224, 224))
    assert logits.shape == (2, 1000)


def test_forward_backward_small_real_input():
    model = ResNet50(num_classes=10)
    logits = model(torch.randn(2, 3, 32, 32))
    logits.sum().backward()
    assert logits.shape == (2, 10) and model.conv1.weight.grad is not None


def test_init_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    first, second = ResNet50(num_classes=10, seed=3), ResNet50(num_classes=10, seed=3)
    assert torch.rand(1) == expected
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
