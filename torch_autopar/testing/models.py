"""Small reference models for tests, examples and benchmarks (deterministic given a seed)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, dims=(32, 64, 64, 8)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x):
        for index, layer in enumerate(self.layers):
            x = layer(x)
            if index < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class BlockMLP(nn.Module):
    """Residual MLP blocks in an ``nn.ModuleList`` and a linear head: parameters dominate a training step's
    memory (the fully-sharded memory tests and bench)."""

    def __init__(self, n_blocks: int = 8, dim: int = 128, hidden: int = 512, out: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
                                    for _ in range(n_blocks))
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@dataclass
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    qkv_bias: bool = False
    """Off by default: the key bias has an exactly-zero true gradient (it shifts every score of a query equally),
    so Adam turns its rounding noise into visible parameter differences between equally correct runs."""


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.qkv_bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, seq, self.n_head, width // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(width // self.n_head)
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = torch.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.out = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2 style decoder: token + position embeddings, pre-norm blocks, tied output head.

    PyTorch's default initialisation (N(0, 1) embeddings): examples that train it apply GPT-2's N(0, 0.02)."""

    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        self.config = config = config or GPTConfig()
        self.tok = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.t()


@torch.no_grad()
def gpt2_init(model: nn.Module) -> None:
    """GPT-2's initialisation (weights N(0, 0.02), zero biases). PyTorch's default N(0, 1) embedding, tied to
    the output head, makes the first logits ~sqrt(n_embd) large, the first loss ~20x ln(vocab), and on CPU a
    large share of the backward's numbers subnormal (1.6-1.9x slower steps): benchmarks should apply this."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


def gpt_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


@dataclass
class LlamaConfig:
    n_layer: int = 2
    dim: int = 64
    n_head: int = 4
    n_kv_head: int = 2
    ffn_dim: int = 172
    vocab_size: int = 256


LLAMA3_8B = LlamaConfig(n_layer=32, dim=4096, n_head=32, n_kv_head=8, ffn_dim=14336, vocab_size=128256)
LLAMA3_70B = LlamaConfig(n_layer=80, dim=8192, n_head=64, n_kv_head=8, ffn_dim=28672, vocab_size=128256)
LLAMA3_405B = LlamaConfig(n_layer=126, dim=16384, n_head=128, n_kv_head=8, ffn_dim=53248, vocab_size=128256)
GPT2_SMALL = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
GPT2_MEDIUM = GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024)
GPT2_XL = GPTConfig(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600)


class LlamaBlock(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, c.dim // c.n_head
        self.attn_norm = RMSNorm(c.dim)
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)
        self.ffn_norm = RMSNorm(c.dim)
        self.w1 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def forward(self, x):
        batch, seq, dim = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        repeat = self.n_head // self.n_kv_head
        k = self.wk(h).view(batch, seq, self.n_kv_head, self.head_dim).transpose(1, 2).repeat_interleave(repeat, dim=1)
        v = self.wv(h).view(batch, seq, self.n_kv_head, self.head_dim).transpose(1, 2).repeat_interleave(repeat, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, dim)
        x = x + self.wo(attn)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """LLaMA-3 style decoder: RMSNorm, grouped-query attention, SwiGLU, untied output head."""

    def __init__(self, config: LlamaConfig | None = None):
        super().__init__()
        c = self.config = config or LlamaConfig()
        self.tok = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(LlamaBlock(c) for _ in range(c.n_layer))
        self.norm = RMSNorm(c.dim)
        self.out = nn.Linear(c.dim, c.vocab_size, bias=False)

    def forward(self, idx):
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


class SmallCNN(nn.Module):
    """Two conv + batch-norm + ReLU stages, global average pooling and a linear classifier (for batch-norm
    semantics in tests: each strategy's treatment of batch statistics is documented in README.md)."""

    def __init__(self, channels: int = 8, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.head = nn.Linear(2 * channels, classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))
