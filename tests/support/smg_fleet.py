"""Two or more `ninfer engine` processes behind the real smg router, for tests that drive the router with the
openai SDK: started, waited on until serving and registered, and stopped whatever happens."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from services.engine_client import EngineClient
from tools.serving.server_process import ServerProcess
from tools.serving.smg_stack import SmgRouter

CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}     # one intra-op thread per engine on the 2-core CI machine


@contextlib.contextmanager
def engines_behind_smg(engine_args: tuple[str, ...], model_dir: str, model: str, log_path: Path,
                       *router_args: str, count: int = 2) -> Iterator[tuple[list[EngineClient], SmgRouter]]:
    """-> (a client of each engine, the router), once the router serves `model` from every engine."""
    engines = [ServerProcess.start("engine", *engine_args, env=CHILD_ENV) for _ in range(count)]
    clients = [EngineClient(e.address) for e in engines]
    router = None
    try:
        for c in clients:
            c.wait_until_serving(timeout_s=60)
        router = SmgRouter.start([e.address for e in engines], model_dir, log_path, *router_args)
        router.wait_until_ready(workers=count, model=model, timeout_s=60)
        yield clients, router
    finally:
        if router is not None:
            router.stop()
        for p in engines:
            if p.proc.poll() is None:
                p.terminate()
                p.wait(30)
        for c in clients:
            c.close()
