"""Host time of one eager prefill (P=512, chunk 4096, qwen3-8b random weights): cProfile of 5 prefills."""
import cProfile, pstats, io, sys, time
import torch
from engine.config import EngineConfig
from engine.core import EngineCore
from tools.profile_prefill import prefill_once

P = int(sys.argv[1]) if len(sys.argv) > 1 else 512
core = EngineCore(EngineConfig(model="preset:qwen3-8b", device="cuda", draft_tokens=0, max_batch=4,
                               prefill_chunk=4096, kv_capacity=8192, max_model_len=4096))
core.warmup()
for i in range(3):
    prefill_once(core, P, seed=i)
walls = [prefill_once(core, P, seed=10 + i) for i in range(5)]
print("wall ms", [round(w * 1e3, 2) for w in walls])
# host-only time: launch the forward and time until the host returns, before syncing
pr = cProfile.Profile()
pr.enable()
for i in range(5):
    prefill_once(core, P, seed=20 + i)
pr.disable()
s = io.StringIO()
st = pstats.Stats(pr, stream=s)
st.sort_stats("tottime").print_stats(45)
st.sort_stats("cumulative").print_stats(60)
print(s.getvalue()[:28000])
