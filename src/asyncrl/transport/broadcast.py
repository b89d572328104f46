"""Policy weights by collective broadcast: trainer rank 0 → the inference process, never through the disk.

The two processes form a process group of their own, two members, apart from the trainer's FSDP group:
the inference process hosts a TCPStore at `weight_transfer.host:port` and the trainer's rank 0 joins it.
The backend is nccl when both ends are on GPUs and gloo otherwise, so CI on CPU runs the same code.

Transfer number n (1, 2, ... for each version the trainer publishes):
  1. the sender puts a header in the store under `transfer/n`: policy version, tensor names, shapes and dtypes
     (and, for a LoRA adapter, its adapter_config.json);
  2. it broadcasts one flat buffer per dtype; the receiver allocates the same buffers and cuts them into tensors.
The trainer then writes `weights/step_N/STABLE` as with files (transport/weights.py), so the orchestrator
waits for versions the same way. The receiver runs in a background thread of the inference server and
keeps the newest version; `/admin/update_weights` without a path makes it live.

Every wait has a timeout (`weight_transfer.timeout`) and an error that names the peer.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from asyncrl.config.schema import WeightTransferConfig
from asyncrl.errors import AsyncRLError
from asyncrl.transport import weights
from asyncrl.transport.waiting import PeerTimeout

log = logging.getLogger("asyncrl.broadcast")

SENDER, RECEIVER = 0, 1
POLL = 0.002  # seconds between checks of a collective in flight: well below any transfer's time
IDLE_POLL = 0.01  # seconds between checks for the next transfer's header (a store round trip each)


def _gpu_id(device: torch.device) -> str | None:
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None


def _group(store: dist.Store, rank: int, backend: str, timeout: float) -> dist.ProcessGroupGloo | dist.ProcessGroupNCCL:
    """The two-member group; blocks until both members joined (gloo) or until the first collective (nccl)."""
    store = dist.PrefixStore("group", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout))


def _broadcast(
    group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL, buffer: torch.Tensor, timeout: float, peer: str
) -> None:
    """Broadcast from the sender; polled so that a peer that never takes part raises instead of hanging."""
    options = dist.BroadcastOptions()
    options.rootRank = SENDER
    work = group.broadcast([buffer], options)
    deadline = time.monotonic() + timeout
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise PeerTimeout(f"weight broadcast: {peer} did not take part within {timeout:.0f}s")
        time.sleep(POLL)
    work.wait()


def _buffers(specs: list[tuple[str, list[int], str]]) -> dict[str, list[int]]:
    """Indices of `specs` per dtype: one flat buffer each, in header order."""
    groups: dict[str, list[int]] = {}
    for index, (_, _, dtype) in enumerate(specs):
        groups.setdefault(dtype, []).append(index)
    return groups


def listen(host: str, port: int) -> socket.socket:
    """The receiver's listening socket, bound first so that a port in use fails at once, with the fix."""
    try:
        return socket.create_server((host, port), backlog=16)
    except OSError as error:
        raise AsyncRLError(
            f"weight broadcast: cannot listen on {host}:{port}: {error.strerror} "
            "(set weight_transfer.port to a free port, or 0 under `asyncrl rl`)"
        ) from None


class WeightSender:
    """Trainer rank 0's end: joins the inference process's group at construction, then sends each version.

    The backend is nccl when both ends are on GPUs, gloo otherwise (tensors then travel through host memory).
    """

    def __init__(self, cfg: WeightTransferConfig, device: torch.device):
        if cfg.port == 0:
            raise AsyncRLError(
                "weight broadcast: weight_transfer.port is 0; give the trainer the port the inference server "
                "listens on (`asyncrl rl` does it for you)"
            )
        self.timeout = cfg.timeout
        self.peer = f"the inference process at {cfg.host}:{cfg.port}"
        self.transfers = 0
        try:
            self.store = dist.TCPStore(cfg.host, cfg.port, 2, is_master=False, timeout=timedelta(seconds=cfg.timeout))
            receiver = json.loads(self.store.get("receiver"))
        except (dist.DistError, RuntimeError) as error:
            raise PeerTimeout(
                f"weight broadcast: could not reach {self.peer} within {cfg.timeout:.0f}s "
                f"({str(error).splitlines()[0]}); is the inference server running with "
                "weight_transfer.mode = 'broadcast' on that port?"
            ) from None
        backend = "nccl" if device.type == "cuda" and receiver["gpu"] is not None else "gloo"
        if backend == "nccl" and receiver["gpu"] == _gpu_id(device):
            raise AsyncRLError(
                "weight broadcast: trainer rank 0 and the inference server are on the same GPU, and NCCL needs "
                "one GPU per process (use weight_transfer.mode = 'filesystem' on one GPU, or give each its own)"
            )
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.store.set("backend", backend)
        self.group = _group(self.store, SENDER, backend, cfg.timeout)

    def send(self, state_dict: Mapping[str, torch.Tensor], version: int, adapter_config: dict | None = None) -> None:
        """Send `state_dict` as policy `version`; returns once the receiver has all of it. `adapter_config`
        marks it as a LoRA adapter to merge into the base model."""
        specs = [(name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state_dict.items()]
        header = {"version": version, "tensors": specs, "adapter_config": adapter_config}
        self.transfers += 1
        self.store.set(f"transfer/{self.transfers}", json.dumps(header))
        tensors = list(state_dict.values())
        for indices in _buffers(specs).values():
            flat = torch.cat([tensors[i].detach().reshape(-1).to(self.device) for i in indices])
            _broadcast(self.group, flat, self.timeout, self.peer)


class WeightReceiver:
    """The inference process's end: a thread that receives every version the trainer sends and keeps the newest.

    The store listens from construction on, so a port in use fails at server start; the trainer may join
    later, within `timeout`.
    """

    def __init__(self, cfg: WeightTransferConfig, device: torch.device):
        self.timeout = cfg.timeout
        self.device = device
        # Our own listening socket: the store then listens on `host` only (loopback by default), and port 0
        # picks a free port.
        self._socket = listen(cfg.host, cfg.port)
        self.port = self._socket.getsockname()[1]
        self.address = f"{cfg.host}:{self.port}"
        self.store = dist.TCPStore(
            cfg.host,
            self.port,
            2,
            is_master=True,
            timeout=timedelta(seconds=cfg.timeout),
            wait_for_workers=False,
            master_listen_fd=self._socket.fileno(),
        )
        self.store.set("receiver", json.dumps({"gpu": _gpu_id(device)}))
        log.info("weight broadcast: waiting for trainer rank 0 at %s", self.address)
        self._newest: tuple[int, dict[str, torch.Tensor]] | None = None
        self._error: Exception | None = None
        self._stopping = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="asyncrl-weight-receiver", daemon=True)
        self._thread.start()

    def take(self, version: int, timeout: float) -> tuple[dict[str, torch.Tensor], int]:
        """The newest received state dict of version >= `version`, and its version. Raises PeerTimeout when
        none arrived in time, or the receiver's own error."""
        with self._changed:
            arrived = self._changed.wait_for(
                lambda: self._error is not None or (self._newest is not None and self._newest[0] >= version), timeout
            )
            if self._error is not None:
                raise self._error
            if not arrived:
                newest = self._newest[0] if self._newest else "none"
                raise PeerTimeout(
                    f"weight broadcast: version {version} did not arrive from trainer rank 0 within {timeout:.0f}s "
                    f"(newest received: {newest}; is the trainer running with weight_transfer.mode = 'broadcast'?)"
                )
            state_dict, newest = self._newest[1], self._newest[0]
        return state_dict, newest

    def stop(self) -> None:
        self._stopping = True
        self._thread.join(timeout=5)

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            try:
                backend = self.store.get("backend").decode()  # set by the trainer when it joins
                group = _group(self.store, RECEIVER, backend, self.timeout)
            except (dist.DistError, RuntimeError):
                raise PeerTimeout(
                    f"weight broadcast: trainer rank 0 did not join at {self.address} within {self.timeout:.0f}s "
                    "(is it running with weight_transfer.mode = 'broadcast' and this host and port?)"
                ) from None
            log.info("weight broadcast: trainer rank 0 joined at %s (%s)", self.address, backend)
            buffer_device = self.device if backend == "nccl" else torch.device("cpu")
            transfer = 1
            while not self._stopping:
                key = f"transfer/{transfer}"
                if not self.store.check([key]):
                    time.sleep(IDLE_POLL)
                    continue
                header = json.loads(self.store.get(key))
                state_dict = self._receive(group, header, buffer_device)
                self.store.delete_key(key)
                with self._changed:
                    self._newest = (header["version"], state_dict)
                    self._changed.notify_all()
                transfer += 1
        except Exception as error:  # noqa: BLE001 - kept for take(), which reports it to the caller
            log.error("%s", error)
            with self._changed:
                self._error = error
                self._changed.notify_all()

    def _receive(
        self, group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL, header: dict, device: torch.device
    ) -> dict[str, torch.Tensor]:
        specs = header["tensors"]
        state_dict: dict[str, torch.Tensor] = {}
        for dtype, indices in _buffers(specs).items():
            sizes = [torch.Size(specs[i][1]).numel() for i in indices]
            flat = torch.empty(sum(sizes), dtype=getattr(torch, dtype), device=device)
            _broadcast(group, flat, self.timeout, "trainer rank 0")
            for index, piece in zip(indices, flat.split(sizes)):
                name, shape, _ = specs[index]
                state_dict[name] = piece.view(shape)
        adapter_config = header["adapter_config"]
        if adapter_config is not None:
            base = weights.base_state_dict(adapter_config["base_model_name_or_path"])
            state_dict = weights.merge_adapter(base, {k: v.cpu() for k, v in state_dict.items()}, adapter_config)
        return state_dict
