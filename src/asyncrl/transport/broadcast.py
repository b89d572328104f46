"""Policy weights from trainer rank 0 to every inference server, never through the disk: by collective
broadcast (mode `broadcast`), or lent inside the GPU they share (mode `colocated`).

Trainer rank 0 and the R inference servers of a run form one process group of their own, R + 1 members,
apart from the trainer's FSDP group. Trainer rank 0 hosts a TCPStore at `weight_transfer.host:port`; each
server joins it as member `weight_transfer.rank` (1 … R, `weight_transfer.receivers` = R; `asyncrl rl`
sets both), and may start first: it keeps trying until the trainer is there. Each server writes which GPU
it is on; the backend is nccl when the trainer and every server are on GPUs of their own, and gloo
otherwise (CPUs, or servers sharing a GPU), so CI on CPU runs the same code. In mode `colocated` every server
must be on trainer rank 0's own device and host, and there is no collective: the backend is `shared`.

Transfer number n (1, 2, ... for each version the trainer publishes):
  1. the sender puts a header in the store under `transfer/n`: policy version, tensor names, shapes and dtypes
     (and, for a LoRA adapter, its adapter_config.json);
  2. it broadcasts one flat buffer per dtype; each receiver allocates the same buffers and cuts them into
     tensors.
  With `shared`, step 2 is instead: the sender copies each tensor into flat buffers it allocated once (on its
  GPU, or in shared host memory on a CPU) and lent to the servers (transport/shared_buffers.py: CUDA IPC
  handles, under `shared/G` in the store, G the buffers' generation, named in the header); each server
  copies them into memory of its own, device to device, and answers `ack/n/RANK`; the sender returns once
  every server answered, so the buffers are free for the next version.
The trainer then writes `weights/step_N/STABLE` as with files (transport/weights.py), so the orchestrator
waits for versions the same way. Each receiver runs in a background thread of its inference server and
keeps the newest version; `/admin/update_weights` without a path makes it live.

A collective needs every member: a server that dies stops the next broadcast (the trainer's wait times out,
or gloo reports the broken connection). Every wait has a timeout (`weight_transfer.timeout`) and an error
that names the peer.
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
from asyncrl.config.transfer_mode import transfer_mode
from asyncrl.errors import AsyncRLError
from asyncrl.transport import shared_buffers, weights
from asyncrl.transport.waiting import PeerTimeout

log = logging.getLogger("asyncrl.broadcast")

SENDER = 0  # trainer rank 0's place in the group; the servers are 1 ... receivers
POLL = 0.002  # seconds between checks of a collective in flight: well below any transfer's time
IDLE_POLL = 0.01  # seconds between checks for the next transfer's header (a store round trip each)


def _gpu_id(device: torch.device) -> str | None:
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None


def _place(device: torch.device) -> dict[str, str | None]:
    """Where a member computes, as every other member can compare it: its host and its GPU (None: a CPU)."""
    return {"host": socket.gethostname(), "gpu": _gpu_id(device)}


def _where(place: dict[str, str | None]) -> str:
    return f"{'GPU ' + place['gpu'] if place['gpu'] else 'the CPU'} of {place['host']}"


def _group(
    store: dist.Store, rank: int, size: int, backend: str, timeout: float
) -> dist.ProcessGroupGloo | dist.ProcessGroupNCCL:
    """The group of trainer rank 0 and every server; blocks until all joined (gloo) or until the first
    collective (nccl)."""
    store = dist.PrefixStore("group", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout))


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
    """The sender's listening socket, bound first so that a port in use fails at once, with the fix."""
    try:
        return socket.create_server((host, port), backlog=128)
    except OSError as error:
        raise AsyncRLError(
            f"weight broadcast: cannot listen on {host}:{port}: {error.strerror} "
            "(set weight_transfer.port to a free port, or 0 under `asyncrl rl`)"
        ) from None


class WeightSender:
    """Trainer rank 0's end: hosts the group's store, waits for every server to join, then sends each version.

    The backend is nccl when the trainer and every server are on GPUs of their own, gloo otherwise (tensors
    then travel through host memory).
    """

    def __init__(self, cfg: WeightTransferConfig, device: torch.device):
        self.timeout = cfg.timeout
        self.size = cfg.receivers + 1
        self._socket = listen(cfg.host, cfg.port)
        self.port = self._socket.getsockname()[1]
        self.address = f"{cfg.host}:{self.port}"
        self.transfers = 0
        self.store = dist.TCPStore(
            cfg.host,
            self.port,
            self.size,
            is_master=True,
            timeout=timedelta(seconds=cfg.timeout),
            wait_for_workers=False,
            master_listen_fd=self._socket.fileno(),
        )
        log.info("weight broadcast: waiting for %d inference server(s) at %s", cfg.receivers, self.address)
        places = []
        for rank in range(1, self.size):
            try:
                places.append(json.loads(self.store.get(f"receiver/{rank}")))
            except (dist.DistError, RuntimeError):
                raise PeerTimeout(
                    f"weight broadcast: inference server {rank} of {cfg.receivers} did not join at {self.address} "
                    f"within {cfg.timeout:.0f}s (is it running with weight_transfer.mode = '{cfg.mode}', this host "
                    "and port, and weight_transfer.rank set?)"
                ) from None
        backend = self._backend(cfg.mode, _place(device), places)
        self.device = device if backend in ("nccl", "shared") else torch.device("cpu")
        self.store.set("backend", backend)
        self.group = None if backend == "shared" else _group(self.store, SENDER, self.size, backend, cfg.timeout)
        self._lent: dict[str, torch.Tensor] = {}  # shared: the buffers the servers read, by dtype
        self._generation = 0
        self.peer = f"the {cfg.receivers} inference server(s) of the group at {self.address}"
        log.info("weight broadcast: %d inference server(s) joined at %s (%s)", cfg.receivers, self.address, backend)

    @staticmethod
    def _backend(mode: str, own: dict, servers: list[dict]) -> str:
        """shared (colocated: every server on this device), nccl (GPUs of their own) or gloo (otherwise)."""
        if transfer_mode(mode).same_device:
            for rank, place in enumerate(servers, 1):
                if place != own:
                    raise AsyncRLError(
                        f"weight_transfer.mode = 'colocated' needs every inference server on trainer rank 0's "
                        f"device, {_where(own)}; inference server {rank} is on {_where(place)} (put them on one "
                        "device, or use weight_transfer.mode = 'broadcast')"
                    )
            return "shared"
        gpus = [place["gpu"] for place in servers]
        if own["gpu"] is not None and own in servers:
            raise AsyncRLError(
                "weight broadcast: trainer rank 0 and an inference server are on the same GPU, and NCCL needs "
                "one GPU per process (use weight_transfer.mode = 'colocated' there, or give each its own GPU)"
            )
        distinct = own["gpu"] is not None and None not in gpus and len(set(gpus)) == len(gpus)
        return "nccl" if distinct else "gloo"

    def send(self, state_dict: Mapping[str, torch.Tensor], version: int, adapter_config: dict | None = None) -> None:
        """Send `state_dict` as policy `version`; returns once every receiver has all of it. `adapter_config`
        marks it as a LoRA adapter to merge into the base model."""
        specs = [(name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state_dict.items()]
        header = {"version": version, "tensors": specs, "adapter_config": adapter_config}
        self.transfers += 1
        if self.transfers > 1:  # every receiver read the previous header before it joined that broadcast
            self.store.delete_key(f"transfer/{self.transfers - 1}")
        tensors = list(state_dict.values())
        if self.group is None:
            self._lend(specs, tensors, header)
            return
        self.store.set(f"transfer/{self.transfers}", json.dumps(header))
        for indices in _buffers(specs).values():
            flat = torch.cat([tensors[i].detach().reshape(-1).to(self.device) for i in indices])
            _broadcast(self.group, flat, self.timeout, self.peer)

    def _lend(self, specs: list[tuple[str, list[int], str]], tensors: list[torch.Tensor], header: dict) -> None:
        """shared: copy into the lent buffers (allocated, and their handles published, when the layout
        changes), announce the version, and wait until every server has copied it out."""
        groups = _buffers(specs)
        sizes = {dtype: sum(tensors[i].numel() for i in indices) for dtype, indices in groups.items()}
        if {dtype: buffer.numel() for dtype, buffer in self._lent.items()} != sizes:
            self._lent = {
                dtype: shared_buffers.allocate(size, getattr(torch, dtype), self.device)
                for dtype, size in sizes.items()
            }
            self._generation += 1
            self.store.set(f"shared/{self._generation}", shared_buffers.share(self._lent))
        for dtype, indices in groups.items():
            torch.cat([tensors[i].detach().reshape(-1).to(self.device) for i in indices], out=self._lent[dtype])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the servers read on streams of their own
        header["shared"] = self._generation
        self.store.set(f"transfer/{self.transfers}", json.dumps(header))
        acks = [f"ack/{self.transfers}/{rank}" for rank in range(1, self.size)]
        try:
            self.store.wait(acks, timedelta(seconds=self.timeout))
        except (dist.DistError, RuntimeError):
            missing = [key.rsplit("/", 1)[1] for key in acks if not self.store.check([key])]
            raise PeerTimeout(
                f"colocated weight transfer: inference server(s) {', '.join(missing)} did not take version "
                f"{header['version']} within {self.timeout:.0f}s"
            ) from None
        for key in acks:
            self.store.delete_key(key)


class WeightReceiver:
    """An inference server's end: a thread that joins trainer rank 0's group, receives every version it sends
    and keeps the newest. The server starts first; the thread keeps trying to reach the trainer for
    `timeout` seconds."""

    def __init__(self, cfg: WeightTransferConfig, device: torch.device):
        if cfg.port == 0:
            raise AsyncRLError(
                "weight broadcast: weight_transfer.port is 0; give the server the port trainer rank 0 listens on "
                "(`asyncrl rl` does it for you)"
            )
        if not 1 <= cfg.rank <= cfg.receivers:
            raise AsyncRLError(
                f"weight broadcast: weight_transfer.rank = {cfg.rank} is not one of the group's inference servers "
                f"1..{cfg.receivers} (weight_transfer.receivers)"
            )
        self.cfg = cfg
        self.timeout = cfg.timeout
        self.device = device
        self.address = f"{cfg.host}:{cfg.port}"
        log.info("weight broadcast: joining trainer rank 0 at %s as member %d", self.address, cfg.rank)
        self._newest: tuple[int, dict[str, torch.Tensor]] | None = None
        self._lent: dict[str, torch.Tensor] = {}  # shared: trainer rank 0's buffers, opened here
        self._generation: int | None = None
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
            if self._error is not None and not (self._newest is not None and self._newest[0] >= version):
                raise self._error
            if not arrived:
                newest = self._newest[0] if self._newest else "none"
                raise PeerTimeout(
                    f"weight broadcast: version {version} did not arrive from trainer rank 0 within {timeout:.0f}s "
                    f"(newest received: {newest}; is the trainer running with weight_transfer.mode = "
                    f"'{self.cfg.mode}'?)"
                )
            state_dict, newest = self._newest[1], self._newest[0]
        return state_dict, newest

    def stop(self) -> None:
        self._stopping = True
        self._thread.join(timeout=5)

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        cfg = self.cfg
        try:
            try:
                self.store = dist.TCPStore(
                    cfg.host, cfg.port, cfg.receivers + 1, is_master=False, timeout=timedelta(seconds=cfg.timeout)
                )
                self.store.set(f"receiver/{cfg.rank}", json.dumps(_place(self.device)))
                backend = self.store.get("backend").decode()  # set by the trainer once every server joined
                group = (
                    None
                    if backend == "shared"
                    else _group(self.store, cfg.rank, cfg.receivers + 1, backend, self.timeout)
                )
            except (dist.DistError, RuntimeError):
                raise PeerTimeout(
                    f"weight broadcast: trainer rank 0 did not open the group at {self.address} within "
                    f"{self.timeout:.0f}s (is it running with weight_transfer.mode = 'broadcast' and this host and "
                    "port, and are all weight_transfer.receivers servers up?)"
                ) from None
            log.info("weight broadcast: trainer rank 0 joined at %s (%s)", self.address, backend)
            buffer_device = self.device if backend == "nccl" else torch.device("cpu")
            transfer = 1
            while not self._stopping:
                key = f"transfer/{transfer}"
                try:
                    waiting = not self.store.check([key])
                except dist.DistNetworkError:
                    newest = self._newest[0] if self._newest else "none"
                    raise PeerTimeout(
                        f"weight broadcast: trainer rank 0 left the group at {self.address} (its run ended, or it "
                        f"stopped); this server keeps the newest version it received ({newest})"
                    ) from None
                if waiting:
                    time.sleep(IDLE_POLL)
                    continue
                header = json.loads(self.store.get(key))
                if group is None:
                    state_dict = self._copy_lent(header, transfer)
                else:
                    state_dict = self._receive(group, header, buffer_device)
                with self._changed:
                    self._newest = (header["version"], state_dict)
                    self._changed.notify_all()
                transfer += 1
        except Exception as error:  # noqa: BLE001 - kept for take(), which reports it to the caller
            log.warning("%s", error)
            with self._changed:
                self._error = error
                self._changed.notify_all()

    def _copy_lent(self, header: dict, transfer: int) -> dict[str, torch.Tensor]:
        """shared: copy the version out of the buffers trainer rank 0 lent (opened once per generation), then
        tell it they are free."""
        if header["shared"] != self._generation:
            self._lent = shared_buffers.open_shared(self.store.get(f"shared/{header['shared']}"), self.device)
            self._generation = header["shared"]
        copies = {dtype: buffer.clone() for dtype, buffer in self._lent.items()}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.store.set(f"ack/{transfer}/{self.cfg.rank}", "")
        return self._unflatten(header, copies)

    def _unflatten(self, header: dict, flats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state dict cut from one flat buffer per dtype; a LoRA adapter merged into the base model."""
        specs = header["tensors"]
        state_dict: dict[str, torch.Tensor] = {}
        for dtype, indices in _buffers(specs).items():
            sizes = [torch.Size(specs[i][1]).numel() for i in indices]
            for index, piece in zip(indices, flats[dtype].split(sizes)):
                name, shape, _ = specs[index]
                state_dict[name] = piece.view(shape)
        adapter_config = header["adapter_config"]
        if adapter_config is not None:
            base = weights.base_state_dict(adapter_config["base_model_name_or_path"])
            state_dict = weights.merge_adapter(base, {k: v.cpu() for k, v in state_dict.items()}, adapter_config)
        return state_dict

    def _receive(
        self, group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL, header: dict, device: torch.device
    ) -> dict[str, torch.Tensor]:
        specs = header["tensors"]
        flats = {}
        for dtype, indices in _buffers(specs).items():
            size = sum(torch.Size(specs[i][1]).numel() for i in indices)
            flats[dtype] = torch.empty(size, dtype=getattr(torch, dtype), device=device)
            _broadcast(group, flats[dtype], self.timeout, "trainer rank 0")
        return self._unflatten(header, flats)
