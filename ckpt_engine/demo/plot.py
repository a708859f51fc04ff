"""The demo's loss plot: the uninterrupted, killed and resumed runs on one chart (needs matplotlib)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .settings import Settings
    from .supervisor import RunLog


def plot_losses(
    path: str,
    s: Settings,
    reference: dict[int, float],
    train: RunLog,
    resume: RunLog,
    killed_at: int,
    resumed_from: int,
) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("Plot: skipped (matplotlib is not installed: pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    steps = sorted(reference)
    ax.plot(steps, [reference[k] for k in steps], color="0.6", linewidth=4, label="uninterrupted run")
    ks = sorted(train.losses)
    ax.plot(ks, [train.losses[k] for k in ks], color="tab:blue", linewidth=1.5, label="run killed mid-save")
    rs = sorted(resume.losses)
    ax.plot(
        rs,
        [resume.losses[k] for k in rs],
        color="tab:orange",
        linestyle="--",
        linewidth=1.5,
        label=f"resumed from iter {resumed_from}",
    )
    saves = sorted(k for k, ev in {**train.saves, **resume.saves}.items() if ev.get("succeeded"))
    for i, k in enumerate(saves):
        ax.axvline(k, color="tab:green", alpha=0.25, linewidth=1, label="checkpoint committed" if i == 0 else None)
    ax.axvline(killed_at, color="tab:red", linewidth=1.5, label=f"SIGKILL during save {killed_at}")
    ax.plot(
        [resumed_from], [reference[resumed_from]], marker="o", color="tab:orange", markersize=8, label="resume point"
    )
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("ckpt-engine demo: killed mid-save, resumed, losses identical")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
