"""Loss factories for training jobs: `train_open(..., loss="flowmesh.losses:label_smoothing")`
or, with arguments, `loss={"factory": "flowmesh.losses:label_smoothing", "kwargs": {"eps": 0.2}}`.

A loss factory is called once, on the worker, when the job opens; it returns a callable
`loss(output, target) -> scalar tensor` that every step (and evaluation) applies to the model's
output (a tensor, or the `logits` of a Hugging Face output) and the step's targets. Any module on
a worker's allow-list (`--allow`) may provide one; this module is allowed on every worker
(`gpu_worker.train_config.LOSS_ALLOW`). Write your own the same way: a plain function returning a
function, deterministic, and differentiable in `output`.

Every callable here can be named as a factory, so this module holds factories and nothing else:
checking a loss spec's form is `flowmesh.train_spec`, resolving it against the allow-list
`gpu_worker.train_config`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _classes_last(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Language-model logits (batch, time, classes) against ids (batch, time): classes are last.
    if output.dim() > 2 and target.dim() == output.dim() - 1:
        return output.reshape(-1, output.shape[-1]), target.reshape(-1)
    return output, target


def label_smoothing(eps: float = 0.1) -> Loss:
    """Cross-entropy against class ids with label smoothing `eps` (0 <= eps < 1): the target
    distribution puts 1 - eps on the class and spreads eps over all classes
    (`torch.nn.functional.cross_entropy(..., label_smoothing=eps)`)."""
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be a number in [0, 1), got {eps!r}")
    smoothing = float(eps)

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out, tgt = _classes_last(output, target)
        return F.cross_entropy(out, tgt, label_smoothing=smoothing)

    return loss


def huber(delta: float = 1.0) -> Loss:
    """Huber loss for regression targets shaped like the output: quadratic within `delta` of the
    target, linear beyond (`torch.nn.functional.huber_loss`)."""
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not delta > 0:
        raise ValueError(f"delta must be a positive number, got {delta!r}")
    d = float(delta)

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.huber_loss(output, target.to(output.dtype), delta=d)

    return loss
