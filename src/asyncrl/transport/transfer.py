"""How new weights travel from the trainer to inference: one strategy object per side, chosen by
`weight_transfer.mode` here and nowhere else.

    side           filesystem (default)                       broadcast
    trainer        write weights/step_N, then STABLE           send to every server, then STABLE alone
                                                               (the last step also in full)
    inference      load the folder it is given                 take the newest version received
    orchestrator   name the folder in /admin/update_weights    name no folder: "take it from the broadcast"

The folder layout and the STABLE contract are transport/weights.py's; the broadcast itself is
transport/broadcast.py's. docs/weights.md is the user's guide.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from asyncrl.config.schema import WeightTransferConfig
from asyncrl.errors import AsyncRLError
from asyncrl.transport import weights
from asyncrl.transport.broadcast import WeightReceiver, WeightSender


class FolderPublisher:
    """Trainer side, filesystem: every version is a complete folder (or a LoRA adapter's)."""

    gather_on_device = False  # the state dict goes to disk: gather it into host memory
    resend_on_resume = False  # a resumed run's new servers read the checkpoint's version from its folder

    def __init__(self, output_dir: Path):
        self.output_dir = Path(output_dir)

    def publish(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        model_config: Any,
        tokenizer: Any,
        adapter_config: dict | None,
        last: bool,
    ) -> None:
        if adapter_config is not None:
            weights.publish_adapter(self.output_dir, version, state_dict, adapter_config)
        else:
            weights.publish(self.output_dir, version, state_dict, model_config, tokenizer)


class BroadcastPublisher(FolderPublisher):
    """Trainer side, broadcast: rank 0 sends each version to every server of the group, cast to the dtype
    inference computes in (bf16 halves the bytes of fp32 master weights), then writes the STABLE marker
    alone, except at the last step, written in full so that the run ends with a usable model."""

    gather_on_device = True  # the sender broadcasts from the GPU when it trains on one
    resend_on_resume = True  # a resumed run's new servers hold the base model, and only a broadcast reaches them

    def __init__(self, output_dir: Path, cfg: WeightTransferConfig, device: torch.device, dtype: torch.dtype):
        super().__init__(output_dir)
        self.sender = WeightSender(cfg, device)
        self.dtype = dtype

    def publish(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        model_config: Any,
        tokenizer: Any,
        adapter_config: dict | None,
        last: bool,
    ) -> None:
        sent = dict(state_dict)
        if adapter_config is None:
            if getattr(model_config, "tie_word_embeddings", False):
                sent.pop("lm_head.weight", None)  # the receiver's model re-ties it
            sent = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in sent.items()}
        self.sender.send(sent, version, adapter_config)
        if last:
            super().publish(version, state_dict, model_config, tokenizer, adapter_config, last)
        else:
            weights.publish_marker(self.output_dir, version)


def make_publisher(
    cfg: WeightTransferConfig, output_dir: Path, device: torch.device, dtype: torch.dtype, is_main: bool
) -> FolderPublisher:
    """The trainer's publisher. Every rank gets one (they gather together); only rank 0's sends or writes,
    and only rank 0 joins the broadcast group."""
    if cfg.mode == "broadcast":
        if not is_main:
            publisher = FolderPublisher(output_dir)
            publisher.gather_on_device = publisher.resend_on_resume = True  # as rank 0's: gathering is collective
            return publisher
        return BroadcastPublisher(output_dir, cfg, device, dtype)
    return FolderPublisher(output_dir)


class FolderSource:
    """Inference side, filesystem: a weight update names the published folder to load."""

    def weights(self, path: str | None, version: int, timeout: float) -> tuple[str | Mapping[str, torch.Tensor], int]:
        if path is None:
            raise AsyncRLError(
                "no path given, and this server receives no weight broadcast (give the path of a published "
                "weights/step_N folder, or start the server with weight_transfer.mode = 'broadcast')"
            )
        return path, version

    def stop(self) -> None:
        pass


class BroadcastSource(FolderSource):
    """Inference side, broadcast: an update without a path takes the newest version >= the one asked for
    that arrived by broadcast (waiting up to `timeout` for it); one with a path loads that folder."""

    def __init__(self, cfg: WeightTransferConfig, device: torch.device):
        self.receiver = WeightReceiver(cfg, device)

    def weights(self, path: str | None, version: int, timeout: float) -> tuple[str | Mapping[str, torch.Tensor], int]:
        if path is not None:
            return path, version
        return self.receiver.take(version, timeout)

    def stop(self) -> None:
        self.receiver.stop()


def make_source(cfg: WeightTransferConfig, device: torch.device) -> FolderSource:
    return BroadcastSource(cfg, device) if cfg.mode == "broadcast" else FolderSource()


def update_source(cfg: WeightTransferConfig, output_dir: Path) -> Callable[[int], Path | None]:
    """Orchestrator side: what a server is told to load version N from — its published folder, or nothing,
    when the folder holds only the STABLE marker and the weights came by broadcast."""
    if cfg.mode == "broadcast":
        return lambda version: None
    return lambda version: weights.weights_dir(output_dir, version)
