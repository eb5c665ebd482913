import time

from app.engine.adapter import from_vllm_params, to_vllm_params
from app.protocol import Role


def _decode_params(expiry_in_s: float = 60.0) -> dict:
    return {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[4, 5, 6]],
            "remote_engine_id": "decode-0", "remote_request_id": "req-1", "remote_host": "10.0.0.2",
            "remote_port": 5601, "tp_size": 1, "remote_num_tokens": 90,
            "remote_blocks_expiry_time": time.perf_counter() + expiry_in_s}


def test_decode_params_round_trip_into_a_prefill_pull():
    handoff = from_vllm_params(_decode_params())
    assert handoff.block_ids == ((4, 5, 6),) and handoff.num_tokens == 90
    assert 55 < handoff.expiry_time - time.time() < 65, "engine deadline converted to Unix time"
    params = to_vllm_params(handoff, Role.PREFILL)
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_block_ids"] == [[4, 5, 6]]
    assert params["remote_blocks_expiry_time"] == handoff.engine_expiry


def test_prefill_params_make_decode_read():
    prefill_params = {**_decode_params(), "do_remote_prefill": True, "do_remote_decode": False,
                      "remote_blocks_expiry_time": None}
    handoff = from_vllm_params(prefill_params)
    assert handoff.expiry_time == 0.0
    params = to_vllm_params(handoff, Role.DECODE)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert "remote_blocks_expiry_time" not in params


def test_kv_events_stay_on_the_node_and_the_nixl_side_channel_binds_the_node_s_address_only():
    from app.config import AppConfig
    from app.engine.settings import assign_identity, engine_args, engine_env

    config = AppConfig()
    identity = assign_identity(config, Role.PREFILL, 0, "127.0.0.1")
    assert engine_env(config, identity)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    args = engine_args(config, config.prefill, identity)
    assert args.kv_events_config.endpoint == identity.engine_events_endpoint
    assert args.kv_events_config.endpoint.startswith("ipc://"), "vLLM publishes on the node only"
    assert not args.kv_events_config.replay_endpoint, "and binds nothing else"
    assert not hasattr(identity, "events_endpoint"), "the events carry token ids: nothing republishes them"
    assert args.kv_transfer_config.kv_connector_extra_config["kv_lease_duration"] == config.handoff_lease_s
    decode = engine_args(config, config.decode, assign_identity(config, Role.DECODE, 0, "127.0.0.1"))
    assert decode.kv_transfer_config.kv_connector_extra_config["kv_lease_duration"] == int(config.retention_ttl_s)
    assert decode.kv_events_config is None, "nobody reads decode's events: the index follows prefill's only"


def test_the_engine_scheduler_limits_come_from_the_config_and_the_peers_get_the_same():
    from app.config import AppConfig, EngineGroupConfig
    from app.engine.settings import assign_identity, engine_args
    from benchmarks.peers import plain_vllm_command, serve_llm_pd_args

    config = AppConfig(engine_max_num_seqs=96, later_turns_first=False,
                       prefill=EngineGroupConfig(engine_kwargs={"max_num_batched_tokens": 1024}),
                       decode=EngineGroupConfig(engine_kwargs={"max_num_batched_tokens": 256,
                                                               "long_prefill_token_threshold": 128}))
    args = engine_args(config, config.decode, assign_identity(config, Role.DECODE, 0, "127.0.0.1"))
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.long_prefill_token_threshold,
            args.scheduling_policy) == (96, 256, 128, "fcfs")
    prefill = engine_args(config, config.prefill, assign_identity(config, Role.PREFILL, 0, "127.0.0.1"))
    assert (prefill.max_num_batched_tokens, prefill.long_prefill_token_threshold) == (1024, 0)
    peer = serve_llm_pd_args(config)
    for group, step_tokens, prompt_tokens in (("prefill_config", 1024, 0), ("decode_config", 256, 128)):
        kwargs = peer[group]["engine_kwargs"]
        assert (kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"], kwargs.get("long_prefill_token_threshold", 0),
                kwargs["scheduling_policy"], kwargs["enforce_eager"]) == (96, step_tokens, prompt_tokens, "fcfs", True)
    command = plain_vllm_command(config, 8000)
    flags = {command[i]: command[i + 1] for i in range(len(command) - 1) if command[i].startswith("--")}
    assert (flags["--max-num-seqs"], flags["--max-num-batched-tokens"], flags["--scheduling-policy"],
            flags["--dtype"]) == ("96", "1024", "fcfs", "float32")
    assert {"--enforce-eager", "--enable-prompt-tokens-details", "--enable-prefix-caching"} <= set(command)
    assert (flags["--tool-call-parser"], flags["--tool-strict-level"]) == ("hermes", "auto")
    assert all(peer[group]["engine_kwargs"]["tool_strict_level"] == "auto"
               for group in ("prefill_config", "decode_config"))
    assert args.scheduler_cls is None and "--scheduler-cls" not in command, "FCFS: vLLM's own scheduler"


def test_every_engine_and_peer_schedules_later_turns_before_running_chunks():
    from app.config import AppConfig
    from app.engine.settings import assign_identity, engine_args
    from benchmarks.peers import plain_vllm_command, serve_llm_pd_args

    config = AppConfig()
    ours = "app.engine.scheduler.LaterTurnsFirstScheduler"
    for role, group in ((Role.PREFILL, config.prefill), (Role.DECODE, config.decode)):
        assert engine_args(config, group, assign_identity(config, role, 0, "127.0.0.1")).scheduler_cls == ours
    assert f"--scheduler-cls {ours}" in " ".join(plain_vllm_command(config, 8000))
    assert all(serve_llm_pd_args(config)[group]["engine_kwargs"]["scheduler_cls"] == ours
               for group in ("prefill_config", "decode_config"))
    off = AppConfig(later_turns_before_chunks=False)
    assert engine_args(off, off.decode, assign_identity(off, Role.DECODE, 0, "127.0.0.1")).scheduler_cls is None


def test_a_request_waiting_on_a_dead_engine_fails_at_once_and_a_cancelled_one_cancels_its_read():
    import asyncio

    import pytest

    from app.engine.adapter import EngineDied, while_alive

    async def outputs(cancelled: list):
        yield "first"
        try:
            await asyncio.sleep(3600)  # the engine never answers again
        except asyncio.CancelledError:
            cancelled.append(True)  # vLLM aborts the request here
            raise
        yield "never"

    async def dies():
        dead, seen = [], []
        stream = while_alive(outputs([]), lambda: bool(dead), poll_s=0.01)
        seen.append(await stream.__anext__())
        dead.append(True)
        with pytest.raises(EngineDied):
            await stream.__anext__()
        return seen

    async def cancelled_by_caller():
        cancelled = []
        stream = while_alive(outputs(cancelled), lambda: False, poll_s=0.01)
        await stream.__anext__()
        reader = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await stream.aclose()
        await asyncio.sleep(0)
        return cancelled

    assert asyncio.run(dies()) == ["first"]
    assert asyncio.run(cancelled_by_caller()) == [True]


def test_engine_ports_lie_outside_the_ephemeral_range_so_no_other_bind_takes_them_first():
    import socket

    from app.engine.ports import _ephemeral_range, free_port

    low, high = _ephemeral_range()
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert all(not low <= p <= high for p in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))  # free when returned


def test_engine_timing_splits_the_first_token_s_wait_from_vllm_s_request_stats():
    import time
    from types import SimpleNamespace

    from app.engine.adapter import engine_timing

    called = time.monotonic() - 1.0
    stats = SimpleNamespace(queued_ts=called + 0.125, scheduled_ts=called + 0.5, first_token_ts=called + 0.75)
    timing = engine_timing(SimpleNamespace(metrics=stats), called)
    assert (timing.admit_ms, timing.queued_ms, timing.step_ms) == (125.0, 375.0, 250.0)
    assert 240 <= timing.deliver_ms < 1000, "from the first token to now, on the same monotonic clock"
    assert engine_timing(SimpleNamespace(metrics=None), called) is None, "stats off: no timing, no error"
    assert engine_timing(SimpleNamespace(metrics=SimpleNamespace(first_token_ts=0.0)), called) is None


def test_the_event_sockets_folder_is_the_user_s_alone(tmp_path, monkeypatch):
    import os
    import stat

    import pytest

    from app.engine.settings import private_socket_dir

    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    folder = private_socket_dir()
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    os.chmod(folder, 0o755)  # made by someone else, or opened up: the node's other users could connect
    with pytest.raises(PermissionError, match="mode 0700"):
        private_socket_dir()
