"""What each weight-transfer mode means to the code that sets a run up (config/transfer_mode.py): the launcher, the
cluster layout and renderers, the schema and the vLLM backend ask it instead of comparing the mode's name."""

from __future__ import annotations

import typing

import pytest

from asyncrl.config.schema import InferenceConfig, OrchestratorConfig, TrainerConfig, WeightTransferConfig
from asyncrl.config.transfer_mode import MODES, fixed_port, transfer_mode
from asyncrl.errors import AsyncRLError


def test_the_schema_offers_exactly_the_modes_there_are():
    assert set(typing.get_args(WeightTransferConfig.model_fields["mode"].annotation)) == set(MODES)


def test_broadcast_is_a_group_without_folders_and_filesystem_the_reverse():
    assert (transfer_mode("broadcast").group, transfer_mode("broadcast").folders) == (True, False)
    assert (transfer_mode("filesystem").group, transfer_mode("filesystem").folders) == (False, True)


def test_only_the_native_backend_takes_a_broadcast():
    assert transfer_mode("broadcast").backend_problem("native") is None
    assert transfer_mode("filesystem").backend_problem("vllm") is None
    assert transfer_mode("broadcast").backend_problem("vllm") == (
        "weight_transfer.mode = 'broadcast' needs inference.backend = 'native' (the vllm backend takes "
        "'filesystem' only: use 'filesystem')"
    )


def sections(mode: str, port: int = 0) -> tuple[list[InferenceConfig], list]:
    transfer = {"mode": mode, "port": port}
    servers = [InferenceConfig(weight_transfer=transfer) for _ in range(3)]
    return servers, [OrchestratorConfig(weight_transfer=transfer), TrainerConfig(weight_transfer=transfer)]


def test_joining_a_broadcast_gives_every_process_the_port_and_each_server_its_member_rank():
    servers, others = sections("broadcast")
    transfer_mode("broadcast").join(servers, others, pick_port=lambda host: 4321)
    assert [s.weight_transfer.rank for s in servers] == [1, 2, 3]
    assert {s.weight_transfer.port for s in [*servers, *others]} == {4321}
    assert {s.weight_transfer.receivers for s in [*servers, *others]} == {3}


def test_a_configured_port_is_kept_and_a_cluster_refuses_port_0():
    servers, others = sections("broadcast", port=29501)
    transfer_mode("broadcast").join(servers, others, pick_port=fixed_port)
    assert {s.weight_transfer.port for s in [*servers, *others]} == {29501}
    with pytest.raises(AsyncRLError, match="set weight_transfer.port, e.g. 29501"):
        transfer_mode("broadcast").join(*sections("broadcast"), pick_port=fixed_port)


def test_the_filesystem_mode_joins_nothing_and_opens_no_port():
    servers, others = sections("filesystem")
    transfer_mode("filesystem").join(servers, others, pick_port=fixed_port)
    assert {(s.weight_transfer.port, s.weight_transfer.rank) for s in servers} == {(0, 1)}
    assert transfer_mode("filesystem").trainer_ports(0) == []
    assert transfer_mode("broadcast").trainer_ports(29501) == [("weights", 29501)]
