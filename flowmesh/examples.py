"""Example models shipped with flowmesh, allow-listed by default, used by the demo and the tests.

Each factory returns a module with `flowmesh_inputs`: the inputs it takes (dim 0 is the batch), so
the partitioner can propagate shapes and the broker can reject a wrong input before it runs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _declare(model: nn.Module, **inputs: tuple[str, list[int]]) -> nn.Module:
    model.flowmesh_inputs = {n: {"dtype": d, "shape": s} for n, (d, s) in inputs.items()}
    return model


def mlp(
    width: int = 256,
    depth: int = 4,
    in_features: int | None = None,
    out_features: int | None = None,
) -> nn.Module:
    """A stack of Linear+GELU layers: depth hidden layers of `width`, then a Linear head."""
    if depth < 1 or width < 1:
        raise ValueError("mlp needs depth >= 1 and width >= 1")
    d_in = in_features or width
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(d_in if i == 0 else width, width), nn.GELU()]
    layers.append(nn.Linear(width, out_features or width))
    return _declare(nn.Sequential(*layers), x=("float32", [-1, d_in]))


class TokenEmbedding(nn.Module):
    def __init__(self, vocab: int, d_model: int, max_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(max_len, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(pos)


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention and MLP, each with a residual connection."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class LMHead(nn.Module):
    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.proj = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(x))


def tiny_gpt(
    vocab: int = 512, d_model: int = 128, n_layers: int = 4, n_heads: int = 4, max_len: int = 64
) -> nn.Module:
    """A small GPT-style decoder: token+position embedding, N blocks, norm and head -> logits."""
    model = nn.Sequential(
        TokenEmbedding(vocab, d_model, max_len),
        *[DecoderBlock(d_model, n_heads) for _ in range(n_layers)],
        LMHead(d_model, vocab),
    )
    return _declare(model, ids=("int64", [-1, -1]))


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class SmallResNet(nn.Module):
    """A torchvision-style ResNet: stem, stages of basic blocks, pooling, flatten, classifier.

    Its children do not form a pure chain (forward flattens between pool and fc), so the
    partitioner has to read it as a traced graph.
    """

    def __init__(
        self,
        num_classes: int = 10,
        width: int = 16,
        blocks: tuple[int, ...] = (2, 2, 2),
        image: int = 32,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        stages, c = [], width
        for i, n in enumerate(blocks):
            c_out = width * 2**i
            stages.append(
                nn.Sequential(
                    *[
                        BasicBlock(c if j == 0 else c_out, c_out, 2 if (i and j == 0) else 1)
                        for j in range(n)
                    ]
                )
            )
            c = c_out
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)
        self.image = image

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        x = torch.flatten(self.pool(x), 1)
        return self.fc(x)


def small_resnet(
    num_classes: int = 10, width: int = 16, blocks: list[int] | None = None, image: int = 32
) -> nn.Module:
    model = SmallResNet(num_classes, width, tuple(blocks or (2, 2, 2)), image)
    return _declare(model, x=("float32", [-1, 3, image, image]))


def hf_gpt2(
    n_layer: int = 4,
    n_embd: int = 128,
    n_head: int = 4,
    vocab_size: int = 1000,
    n_positions: int = 128,
) -> nn.Module:
    """A Hugging Face GPT-2 built from a config with random weights (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        vocab_size=vocab_size,
        n_positions=n_positions,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return _declare(GPT2LMHeadModel(cfg), input_ids=("int64", [-1, -1]))


def hf_opt(
    num_hidden_layers: int = 4,
    hidden_size: int = 128,
    num_attention_heads: int = 4,
    ffn_dim: int | None = None,
    vocab_size: int = 1000,
    max_position_embeddings: int = 128,
) -> nn.Module:
    """A Hugging Face OPT decoder built from a config with random weights (no download)."""
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        num_hidden_layers=num_hidden_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        ffn_dim=ffn_dim or 4 * hidden_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        word_embed_proj_dim=hidden_size,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        attn_implementation="eager",
    )
    return _declare(OPTForCausalLM(cfg), input_ids=("int64", [-1, -1]))


def param_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


__all__ = ["hf_gpt2", "hf_opt", "mlp", "param_bytes", "small_resnet", "tiny_gpt"]
