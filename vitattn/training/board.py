"""A run's curves for TensorBoard (``tensorboard --logdir runs``), written with torch's own
``torch.utils.tensorboard.SummaryWriter``.

    <run folder>/tensorboard/<family>/            one event folder per model (a run of one seed)
    <run folder>/tensorboard/<family>/seed<k>/    one per model and seed (--seeds)

Scalars, on the axis of training steps: every ``loop.READ_EVERY`` steps the epoch's running train
loss and accuracy, the lr and images/s (``train/*``, ``lr``, ``images_per_s``); after each epoch
its train and test figures (``epoch/*``); at the end the final accuracies and the global-context
measures (``final/*``, ``context/*``). A resumed run opens each folder with ``purge_step`` at its
checkpoint's step, so TensorBoard drops what the stopped session wrote after it and the curves go
on without a duplicate step. Off with ``--no-tensorboard``, or where tensorboard is not installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def available() -> bool:
    """Whether torch's SummaryWriter can be used (it needs the ``tensorboard`` package)."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


class Board:
    """The event folders of one model's run, one per seed; ``add(step, values)`` writes one dict
    of scalars per seed, in the order of ``seeds``. ``purge_step``: what earlier sessions wrote at
    that step and after is dropped (TensorBoard's purge), for a resumed run."""

    def __init__(self, out: Path, family: str, seeds: Sequence[int], purge_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        root = Path(out) / "tensorboard" / family
        folders = [root] if len(seeds) == 1 else [root / f"seed{k}" for k in seeds]
        # purge_step 0 too: a run resumed with no checkpoint yet starts its curves again from step 0
        self.writers = [SummaryWriter(str(f), purge_step=purge_step) for f in folders]

    def add(self, step: int, values: Sequence[dict[str, float]]) -> None:
        for writer, scalars in zip(self.writers, values):
            for tag, v in scalars.items():
                writer.add_scalar(tag, v, step)

    def flush(self) -> None:
        for w in self.writers:
            w.flush()

    def close(self) -> None:
        for w in self.writers:
            w.close()


def final_scalars(result: dict) -> list[dict[str, float]]:
    """A model's end-of-run figures as scalars, one dict per seed: accuracies, the effective
    receptive field's radius per layer and the attention distance per block (mean over heads)."""
    out = []
    for r in result.get("per_seed", [result]):
        s = {f"final/{k.removeprefix('final_')}": float(v) for k, v in r.items()
             if k.startswith("final_") and isinstance(v, (int, float))}
        for i, radius in enumerate(r.get("erf_radius_px", [])):
            s[f"context/erf_radius_px/layer{i}"] = float(radius)
        for i, heads in enumerate(r.get("attention_distance_px", [])):
            s[f"context/attention_distance_px/block{i}"] = sum(heads) / len(heads)
        out.append(s)
    return out
