"""The user models of tests/distributed/test_engine.py and tests/e2e/test_py_model_cli.py: plain
PyTorch, nothing of threefold (importable by name, so spawned ranks and `py:` can build them)."""

import torch
from torch import nn


class ConvBN(nn.Module):
    """A small convolutional classifier with batch norm (running statistics: buffers)."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


class ViT(nn.Module):
    """A ViT-style encoder from torch.nn.TransformerEncoder over 4x4 patches of 8x8 images."""

    def __init__(self, dim: int = 16, classes: int = 5):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.pos = nn.Parameter(torch.randn(1, 4, dim) * 0.02)
        # bias=False: the key bias's gradient is identically zero (softmax is shift invariant), and Adam
        # would turn its rounding noise into steps that no two summation orders share
        layer = nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True, bias=False)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.encoder(h).mean(dim=1))


class FrozenShared(nn.Module):
    """A frozen layer, one weight used twice (shared by two modules), and a parameter no step uses."""

    def __init__(self, dim: int = 12, classes: int = 5):
        super().__init__()
        self.inp = nn.Linear(192, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.b.weight = self.a.weight  # shared: one parameter, two modules
        self.unused = nn.Linear(dim, dim)  # never called
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h = torch.tanh(self.inp(x.flatten(1)))
        h = torch.tanh(self.frozen(h))
        h = torch.tanh(self.b(torch.tanh(self.a(h))))
        return self.head(h)


class TinyLM(nn.Module):
    """The `py:` contract: token ids (batch, seq) -> logits (batch, seq, vocab_size)."""

    vocab_size = 64

    def __init__(self, dim: int = 16, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(self.vocab_size, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
                                    for _ in range(layers))
        self.out = nn.Linear(dim, self.vocab_size)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


def tiny_lm() -> nn.Module:
    return TinyLM()
