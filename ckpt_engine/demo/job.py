"""The demo's training job: the model, the data of each step, and one training step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .settings import Settings

if TYPE_CHECKING:
    import torch
    from torch import nn


def build_model(s: Settings) -> nn.Module:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.fc = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = x + nn.functional.gelu(self.fc(self.norm(x)))
            return out

    class DemoNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(s.in_dim, s.hidden)
            self.blocks = nn.ModuleList(Block(s.hidden) for _ in range(s.layers))
            self.head = nn.Linear(s.hidden, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.stem(x)
            for block in self.blocks:
                h = block(h)
            out: torch.Tensor = self.head(h)
            return out

    torch.manual_seed(s.seed)
    return DemoNet()


def teacher_targets(s: Settings, x: torch.Tensor) -> torch.Tensor:
    """A fixed smooth function of the inputs for the model to learn."""
    import torch

    g = torch.Generator().manual_seed(s.seed + 4242)
    w = torch.randn(s.in_dim, 8, generator=g) / s.in_dim**0.5
    return torch.sin(x @ w).sum(dim=1, keepdim=True)


def batch_for(s: Settings, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one step is a function of the step: a resumed run sees the same batches."""
    import torch

    g = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
    x = torch.randn(s.batch, s.in_dim, generator=g)
    y = teacher_targets(s, x)
    return x[rank::world], y[rank::world]


@dataclass
class Job:
    settings: Settings
    model: Any
    optimizer: Any
    scheduler: Any
    scaler: Any
    rank: int = 0
    world: int = 1

    @classmethod
    def create(cls, s: Settings, rank: int = 0, world: int = 1) -> Job:
        import torch

        model = build_model(s)
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks:  # type: ignore[union-attr]
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=s.steps, eta_min=s.lr * 0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=5)
        return cls(s, model, optimizer, scheduler, scaler, rank, world)

    def objects(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "grad_scaler": self.scaler,
        }

    def step(self, step: int) -> float:
        import torch
        from torch import nn

        x, y = batch_for(self.settings, step, self.rank, self.world)
        loss = nn.functional.mse_loss(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        value = loss.detach().clone()
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(value)
            value /= self.world
        return float(value.to(torch.float64))


def parameter_count(s: Settings) -> int:
    return sum(p.numel() for p in build_model(s).parameters())
