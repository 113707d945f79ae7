"""torch's own linear layer on plain [out, in] weights: the model is built of these, and they stay
wherever the choice table keeps torch's kernel (MKL or oneDNN behind torch.nn.functional.linear)."""

from __future__ import annotations

from torch import nn


class Linear(nn.Linear):
    """nn.Linear without its random init: the model is built on the meta device and the loader fills
    every weight (one left unread is an error), so the init would only cost start-up time."""

    def reset_parameters(self) -> None:
        pass
