"""How new weights travel from the trainer to inference: one strategy object per side, chosen here from what
the mode is (config/transfer_mode.py, which the launcher, the clusters, the schema and the backends ask too).

    side           filesystem (default)                       broadcast
    trainer        write weights/step_N, then STABLE, in a     send to every server, then STABLE alone
                   background thread (in the serving dtype;    (in the serving dtype; the last step also
                   the last step in full precision)            written in full precision)
    inference      load the folder it is given                 take the newest version received
    orchestrator   name the folder in /admin/update_weights    name no folder: "take it from the broadcast"

The folder layout and the STABLE contract are transport/weights.py's; the broadcast itself is
transport/broadcast.py's. docs/weights.md is the user's guide.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from asyncrl.config.schema import WeightTransferConfig
from asyncrl.config.transfer_mode import transfer_mode
from asyncrl.errors import AsyncRLError
from asyncrl.transport import weights
from asyncrl.transport.broadcast import WeightReceiver, WeightSender


def to_serving_dtype(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors cast to the dtype inference computes in: with bf16 serving, half the bytes of the
    fp32 master weights to write or send, and the same values the server would round them to."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}


class FolderPublisher:
    """Trainer side, filesystem: every version is a complete folder (or a LoRA adapter's). Versions are
    written in the serving dtype, except the last, which is the run's final model: in full precision.

    The folder is written in a background thread: the trainer hands over the gathered tensors (which must not
    be the model's own) and goes on with its next step while they reach the disk, STABLE last. One version is
    written at a time: `publish` first waits for the one before, and `wait` for the last, re-raising what
    failed in writing it."""

    gather_on_device = False  # the state dict goes to disk: gather it into host memory
    resend_on_resume = False  # a resumed run's new servers read the checkpoint's version from its folder

    def __init__(self, output_dir: Path, dtype: torch.dtype = torch.float32, keep: int | None = None):
        self.output_dir = Path(output_dir)
        self.dtype = dtype
        self.keep = keep  # newest versions kept on disk (None: all)
        self._writer: threading.Thread | None = None
        self._failure: BaseException | None = None

    def publish(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        model_config: Any,
        tokenizer: Any,
        adapter_config: dict | None,
        last: bool,
    ) -> None:
        self.wait()
        args = (version, dict(state_dict), model_config, tokenizer, adapter_config, last)
        self._writer = threading.Thread(target=self._write, args=args, name=f"publish-step-{version}")
        self._writer.start()

    def _write(
        self,
        version: int,
        state_dict: dict[str, torch.Tensor],
        model_config: Any,
        tokenizer: Any,
        adapter_config: dict | None,
        last: bool,
    ) -> None:
        try:
            if adapter_config is not None:
                weights.publish_adapter(self.output_dir, version, state_dict, adapter_config)
            else:
                written = state_dict if last else to_serving_dtype(state_dict, self.dtype)
                weights.publish(self.output_dir, version, written, model_config, tokenizer)
            self._prune()
        except BaseException as error:  # noqa: BLE001 - re-raised in the trainer's thread by wait()
            self._failure = error

    def _prune(self) -> None:
        if self.keep is not None:
            weights.prune(self.output_dir, self.keep)

    def wait(self) -> None:
        """Return once the last version handed over is on disk; raise what failed in writing it."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure


class BroadcastPublisher(FolderPublisher):
    """Trainer side, broadcast: rank 0 sends each version to every server of the group, cast to the dtype
    inference computes in (bf16 halves the bytes of fp32 master weights), then writes the STABLE marker
    alone, except at the last step, written in full so that the run ends with a usable model."""

    gather_on_device = True  # the sender broadcasts from the GPU when it trains on one
    resend_on_resume = True  # a resumed run's new servers hold the base model, and only a broadcast reaches them

    def __init__(
        self, output_dir: Path, cfg: WeightTransferConfig, device: torch.device, dtype: torch.dtype, keep: int | None
    ):
        super().__init__(output_dir, dtype, keep)
        self.sender = WeightSender(cfg, device)

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
            sent = to_serving_dtype(sent, self.dtype)
        self.sender.send(sent, version, adapter_config)
        if last:
            super().publish(version, state_dict, model_config, tokenizer, adapter_config, last)
        else:
            weights.publish_marker(self.output_dir, version)
            self._prune()


def make_publisher(
    cfg: WeightTransferConfig,
    output_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    is_main: bool,
    keep: int | None = None,
) -> FolderPublisher:
    """The trainer's publisher. Every rank gets one (they gather together); only rank 0's sends or writes,
    and only rank 0 joins the broadcast group. `keep`: the newest versions kept on disk (None: all)."""
    if transfer_mode(cfg.mode).group:
        if not is_main:
            publisher = FolderPublisher(output_dir, dtype)
            publisher.gather_on_device = publisher.resend_on_resume = True  # as rank 0's: gathering is collective
            return publisher
        return BroadcastPublisher(output_dir, cfg, device, dtype, keep)
    return FolderPublisher(output_dir, dtype, keep)


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
    return BroadcastSource(cfg, device) if transfer_mode(cfg.mode).group else FolderSource()


def update_source(cfg: WeightTransferConfig, output_dir: Path) -> Callable[[int], Path | None]:
    """Orchestrator side: what a server is told to load version N from — its published folder, or nothing,
    when the folder holds only the STABLE marker and the weights came by broadcast."""
    if not transfer_mode(cfg.mode).folders:
        return lambda version: None
    return lambda version: weights.weights_dir(output_dir, version)
