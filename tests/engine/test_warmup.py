"""Every entry point runs the one warm-up before it serves, and says what it did (on the CPU: no CUDA
graphs, and why). A served engine that skipped its warm-up would report `done: false` here."""

from __future__ import annotations

import time

import grpc

from tests.conftest import make_llm
from engine.config import EngineConfig
from gateway.serve import ServeStack
from ninfer.v1 import engine_info_pb2, engine_info_pb2_grpc
from services.server.grpc_server import ServerOptions
from tools.serving.server_process import ServerProcess

CPU_REASON = "CPU engine: CUDA graphs need a CUDA device"


def test_the_offline_api_warms_up_in_its_constructor():
    llm = make_llm(None, kv_capacity=1024)
    assert llm.warmup.done and not llm.warmup.cuda_graphs and llm.warmup.no_graphs_reason == CPU_REASON
    assert llm.engine.info().warmup == llm.warmup
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks       # the warm-up left nothing behind
    assert llm.engine.snapshot()["performance"]["requests"] == {}


def test_serve_reports_its_warm_up_in_the_engine_info():
    stack = ServeStack(EngineConfig(device="cpu", kv_capacity=1024), ServerOptions(listen="127.0.0.1:0"))
    try:
        stack.start()
        with grpc.insecure_channel(stack.engine.address) as channel:
            info = engine_info_pb2_grpc.EngineInfoServiceStub(channel).GetModelInfo(
                engine_info_pb2.GetModelInfoRequest(), metadata=(("authorization", f"Bearer {stack.engine_api_key}"),))
        w = info.warmup
        assert w.done and not w.cuda_graphs and list(w.graph_buckets) == [] and w.no_graphs_reason == CPU_REASON
        assert w.seconds > 0
        # the kernel families the device takes (engine/platform.py): the CPU's
        assert info.kernel_paths["capability"] == "cpu" and info.kernel_paths["attention_decode"] == "torch"
        assert info.kernel_paths["dtype"] == info.dtype
    finally:
        stack.stop()


def test_an_engine_process_logs_its_warm_up_before_it_serves():
    with ServerProcess.start("engine", "--device", "cpu", "--kv-capacity", "1024") as engine:
        with grpc.insecure_channel(engine.address) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = engine_info_pb2_grpc.EngineInfoServiceStub(channel)
            deadline = time.monotonic() + 60
            while True:
                try:
                    info = stub.GetModelInfo(engine_info_pb2.GetModelInfoRequest(), timeout=10)
                    break
                except grpc.RpcError as e:          # UNAVAILABLE while loading and warming up
                    assert e.code() is grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
                    time.sleep(0.1)
        assert info.warmup.done and info.warmup.no_graphs_reason == CPU_REASON
        serving = engine.wait_for_event("engine_serving")   # logged just after it turns SERVING
        names = [e["event"] for e in engine.events]
        assert names.index("kernel_paths") < names.index("memory_plan") < names.index("weights_loaded") < names.index("engine_warming_up") \
            < names.index("engine_warm") < names.index("engine_serving")
        assert serving["cuda_graphs"] is False and serving["no_graphs_reason"] == CPU_REASON
