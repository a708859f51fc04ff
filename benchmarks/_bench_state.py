"""Synthetic states for the benchmark suite: transformer-like and many-small-tensor."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

MIB = 1 << 20


def transformer_shapes(target_bytes: int, layers: int = 12) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """About 200 tensors shaped like a decoder-only transformer, totalling about ``target_bytes``.

    Per layer: q, k, v, o (h x h) and the MLP (4h x h, h x 4h) in bf16, their biases and two
    layer norms in fp32 (16 tensors); plus an fp32 embedding and output head (8h x h each) and a
    final norm: 196 tensors. ``h`` is a multiple of 64 chosen to hit the target size.
    """
    # bytes ~= layers * 12 h^2 * 2 (bf16) + 2 * 8h * h * 4 (fp32) = (24 layers + 64) h^2
    h = max(64, int(math.sqrt(target_bytes / (24 * layers + 64)) / 64 + 0.5) * 64)
    vocab = 8 * h
    out: list[tuple[str, tuple[int, ...], torch.dtype]] = [("embed.weight", (vocab, h), torch.float32)]
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("q", "k", "v", "o"):
            out.append((f"{p}attn.{name}.weight", (h, h), torch.bfloat16))
            out.append((f"{p}attn.{name}.bias", (h,), torch.float32))
        out.append((f"{p}mlp.up.weight", (4 * h, h), torch.bfloat16))
        out.append((f"{p}mlp.up.bias", (4 * h,), torch.float32))
        out.append((f"{p}mlp.down.weight", (h, 4 * h), torch.bfloat16))
        out.append((f"{p}mlp.down.bias", (h,), torch.float32))
        for norm in ("ln1", "ln2"):
            out.append((f"{p}{norm}.weight", (h,), torch.float32))
            out.append((f"{p}{norm}.bias", (h,), torch.float32))
    out += [("norm.weight", (h,), torch.float32), ("norm.bias", (h,), torch.float32)]
    out.append(("head.weight", (vocab, h), torch.float32))
    return out


def small_shapes(count: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``count`` tiny fp32 tensors (16 elements): planning and metadata dominate."""
    return [(f"p{i}", (16,), torch.float32) for i in range(count)]


def make_tensors(shapes: list[tuple[str, tuple[int, ...], torch.dtype]], fill: bool = True) -> dict[str, torch.Tensor]:
    """Allocated and touched tensors (a cheap, deterministic, non-constant fill; no compression
    is involved anywhere, so the content does not matter beyond every page being real)."""
    out: dict[str, torch.Tensor] = {}
    for i, (name, shape, dtype) in enumerate(shapes):
        t = torch.empty(shape, dtype=dtype)
        if fill:
            flat = t.view(-1)
            flat.fill_(float(i % 97) / 7.0)
            if flat.numel():
                flat[:: max(1, flat.numel() // 8)] = float(i)
        else:
            t.zero_()
        out[name] = t
    return out


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class StateModule(nn.Module):
    """An ``nn.Module`` whose state dict is exactly the given tensors (as frozen parameters)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            owner: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                child = owner._modules.get(part)
                if child is None:
                    child = nn.Module()
                    owner.add_module(part, child)
                owner = child
            owner.register_parameter(leaf, nn.Parameter(tensor, requires_grad=False))


def tensors_of(module: nn.Module) -> dict[str, Any]:
    return {k: v.detach() for k, v in module.state_dict().items()}
