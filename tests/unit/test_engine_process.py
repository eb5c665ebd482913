"""The vLLM plugin that engine processes run on themselves (app/engine/process.py)."""


def test_engine_processes_lower_their_own_priority_and_the_process_owning_the_engine_keeps_its(monkeypatch):
    import multiprocessing
    import os

    from app.engine import process as engine_process

    calls, watched = [], []
    monkeypatch.setattr(os, "setpriority", lambda *args: calls.append(args))
    monkeypatch.setattr(os, "getpriority", lambda *args: 15)  # Ray's worker niceness, inherited
    monkeypatch.setattr(engine_process, "exit_with_parent", lambda: watched.append(True))
    monkeypatch.setenv(engine_process.ENGINE_NICE_ENV, "19")
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: None)  # a Serve replica, vLLM's API server
    engine_process.register()
    assert calls == [] and watched == []
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())  # EngineCore, its workers
    engine_process.register()
    assert calls == [(os.PRIO_PROCESS, 0, 19)] and watched == [True]
    monkeypatch.setenv(engine_process.ENGINE_NICE_ENV, "10")  # would raise it: the engine keeps 15
    engine_process.register()
    assert calls[-1] == (os.PRIO_PROCESS, 0, 15)
    monkeypatch.setenv(engine_process.ENGINE_NICE_ENV, "0")
    engine_process.register()
    assert len(calls) == 2


def test_engine_processes_limit_how_long_their_shared_memory_readers_spin(monkeypatch, tmp_path):
    import multiprocessing

    import zmq
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from app.engine import process as engine_process

    monkeypatch.setattr(SpinCondition, "__init__", SpinCondition.__init__)  # all restored after the test
    monkeypatch.setattr(SpinCondition, "wait", SpinCondition.wait)
    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS)
    monkeypatch.setattr(engine_process, "exit_with_parent", lambda: None)
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())  # EngineCore, its workers
    context = zmq.Context()

    def reader_spin_s() -> float:
        reader = SpinCondition(True, context, f"ipc://{tmp_path}/notify")
        for socket in (reader.local_notify_socket, reader.write_cancel_socket, reader.read_cancel_socket):
            socket.close(linger=0)
        return reader.busy_loop_s

    from torch.distributed import distributed_c10d

    monkeypatch.setattr(distributed_c10d, "_new_process_group_helper", distributed_c10d._new_process_group_helper)
    for name in (engine_process.SHM_BUSY_POLL_ENV, engine_process.SHM_RECHECK_ENV,
                 engine_process.SHM_IDLE_RECHECK_ENV, engine_process.ONE_GLOO_DEVICE_ENV):
        monkeypatch.delenv(name, raising=False)
    engine_process.register()
    # vLLM's own, where the engine adapter set nothing
    assert reader_spin_s() == 1 and shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 5000
    for name, value in engine_process.plugin_env(0, 0.001, 2).items():  # nice 0: this process keeps its own
        monkeypatch.setenv(name, value)
    engine_process.register()
    engine_process.register()  # a second registration wraps vLLM's method, not its own wrapper
    assert reader_spin_s() == 0.001 and shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 2
    context.term()


def test_an_idle_shared_memory_reader_rechecks_less_often_and_a_deadline_stands(monkeypatch):
    import time

    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from app.engine import process as engine_process

    waits = []
    monkeypatch.setattr(SpinCondition, "wait", lambda self, timeout_ms=None: waits.append(timeout_ms))
    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS)
    engine_process.limit_shared_memory_spin(0.001, 2, 20)
    engine_process.limit_shared_memory_spin(0.001, 2, 20)  # wraps vLLM's method, not its own wrapper
    reader = SpinCondition.__new__(SpinCondition)
    now = time.monotonic()
    for idle_s in (0.0, 0.1, 1.0, 60.0):
        reader.last_read = now - idle_s
        reader.wait(timeout_ms=2)
    reader.wait(timeout_ms=1)  # a deadline closer than the recheck
    assert waits == [2, 5, 20, 20, 1]
    engine_process.limit_shared_memory_spin(0.001, 2, 0)  # no idle recheck: vLLM's wait, the fixed recheck
    reader.wait(timeout_ms=2)
    assert waits[-1] == 2 and engine_process.plugin_env(0, 0.001, 2)[engine_process.SHM_IDLE_RECHECK_ENV] == "2"


GLOO_GROUPS = """
import os, sys, torch, torch.distributed as dist
from app.engine import process as engine_process
if sys.argv[2] == "one":
    engine_process.share_one_gloo_device()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
for group in [dist.new_group([0], backend="gloo") for _ in range(12)]:
    tensor = torch.ones(2)
    dist.all_reduce(tensor, group=group)
    dist.barrier(group=group)
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(names.count("gloo_tcp_loop"), dist.get_backend(group))
"""


def test_an_engine_process_s_gloo_groups_share_one_transport_thread(tmp_path):
    """vLLM's workers make 13 gloo groups; each device's transport thread wakes every 10 ms."""
    import subprocess
    import sys

    from app.engine.ports import free_port

    script = tmp_path / "groups.py"
    script.write_text(GLOO_GROUPS)

    def transport_threads(how: str) -> list[str]:
        """Two tries: torch's own gloo once aborted (SIGABRT) in the suite beside the running app,
        which is not what this test checks; its stderr says why if it happens twice."""
        for _ in range(2):
            run = subprocess.run([sys.executable, str(script), str(free_port("127.0.0.1")), how], text=True,
                                 capture_output=True, timeout=60)
            if run.returncode == 0:
                return run.stdout.split()
        raise AssertionError(f"{how}: exit {run.returncode}: {run.stderr[-2000:]}")

    assert {how: transport_threads(how) for how in ("one", "torch's")} == {"one": ["1", "gloo"],
                                                                          "torch's": ["13", "gloo"]}


ORPHAN_PARENT = """
import multiprocessing, sys, time
from app.engine import process as engine_process

def engine():
    engine_process.register()
    time.sleep(600)

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=engine)
    child.start()
    print(child.pid, flush=True)
    time.sleep(600)
"""


def test_an_engine_process_whose_parent_is_killed_exits_instead_of_living_on(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(ORPHAN_PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    child = int(parent.stdout.readline())
    time.sleep(1.0)  # the child is up and watching
    parent.send_signal(signal.SIGKILL)  # as Ray kills a replica
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.2)
    alive = _alive(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the orphaned engine process lived on"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False
