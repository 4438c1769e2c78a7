"""A tiny GPT-style character LM: big enough to be a real transformer, small enough for CPU.

Pre-LN blocks with causal self-attention and an MLP, learned token and position embeddings and a
head tied to the token embedding (~1.2 M parameters). Nothing in it is random at run time (no
dropout), so with one thread on CPU the same seed and batches give bitwise-equal parameters,
which is what the demo's lossless check compares
(trainer_hooks/final_state.py digests them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 6
    n_head: int = 4
    n_embd: int = 128


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: the head reads the embedding matrix
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of the next character at every position of ``idx`` ([batch, time])."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self(idx), targets)


class _FirstStage(nn.Module):
    def __init__(self, model: TinyGPT, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.tok, self.pos, self.blocks = model.tok, model.pos, nn.ModuleList(blocks)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return x


class _LastStage(nn.Module):
    def __init__(self, model: TinyGPT, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks, self.ln_f = nn.ModuleList(blocks), model.ln_f
        self.head = nn.Linear(model.config.n_embd, model.config.vocab_size, bias=False)
        self.head.weight = nn.Parameter(model.tok.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def pipeline_stages(model: TinyGPT) -> tuple[nn.Module, nn.Module]:
    """The model as two pipeline stages: the embeddings and the first half of the blocks, then
    the rest and the head. The head starts as a copy of the embedding instead of sharing it
    (the stages live on different ranks; torchtitan unties them for pipelining too)."""
    half = len(model.blocks) // 2
    blocks = list(model.blocks)
    return _FirstStage(model, blocks[:half]), _LastStage(model, blocks[half:])


def tensor_parallel(model: TinyGPT, mesh: DeviceMesh) -> DeviceMesh:
    """Tensor parallel as Megatron splits a feed-forward: each block's first layer by its
    columns, the second by the rows that meet them, over the mesh's "tp" dimension; returns the
    part of the mesh left for data parallelism. (Attention stays whole: its fused qkv would
    need its heads split.)"""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
    return mesh[tuple(name for name in mesh.mesh_dim_names or () if name != "tp")]


def data_coordinate(data_mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's place among the data-parallel coordinates of ``data_mesh``, and their
    number: the ranks of one tp group read the same batches."""
    flat = data_mesh._flatten()
    return flat.get_local_rank(), flat.size()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-character cross-entropy; a wrapper such as DDP calls it on its own forward."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
