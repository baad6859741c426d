"""lm-evaluation-harness (`lm-eval[api]`, local task files, no hub) through the real smg router in front
of a `ninfer engine`: a generate-until task end to end over OpenAI completions, its exact-match score
equal to the one computed from the float32 reference's greedy continuations.

Not pinned in the `test` extra (lm-eval pulls pandas, pyarrow, scipy, scikit-learn, datasets, nltk):
this module skips without it (`pip install 'lm-eval[api]==0.4.13'`).

The loglikelihood (multiple-choice) side cannot run through smg 1.13: the harness scores with
/v1/completions `echo` + `logprobs` (max_tokens 1) and reads `choices[i].logprobs.token_logprobs`,
and smg 1.13 returns no logprobs for completions at all (chat logprobs carry no prompt). The engine
serves the prompt logprobs that scoring needs on both of its protocols (tests/engine/test_logprobs.py,
tests/services/smg/test_vllm_servicer.py, tests/gateway/test_sampling_fields.py); what is missing is
an OpenAI-compatible completions path that hands them on."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from services.engine_client import EngineClient
from tests.support.sampling_reference import load_reference_model, reference_greedy
from tools.serving.server_process import ServerProcess
from tools.serving.smg_stack import SmgRouter, smg_command

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval[api] is not installed (too heavy for the test extra)")
pytestmark = pytest.mark.skipif(smg_command() is None, reason="smg is not installed (the `test` extra installs it)")

MODEL = "tiny-qwen3-mtp"
DOCS = [
    {"prompt": "Line 1: the quick brown fox jumps over the lazy dog.\nLine 2:",
     "target": " the quick brown fox jumps over the lazy dog."},
    {"prompt": "- harbor 1\n- harbor 2\n- harbor 3\n-", "target": " harbor 4"},
    {"prompt": "1. item 1\n2. item 2\n3.", "target": " item 3"},
    {"prompt": "def fibonacci(n):", "target": " return n"},            # likely missed: the score is not 1
    {"prompt": "He who laughs last", "target": " laughs best"},
]
TASK = """task: ninfer_continue
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 24
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def router(shared_model, tmp_path_factory):
    engine = ServerProcess.start("engine", "--model", shared_model, "--kv-capacity", "4096",
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout_s=300)
    client = EngineClient(engine.address)
    smg = None
    try:
        client.wait_until_serving(timeout_s=60)
        smg = SmgRouter.start([engine.address], shared_model, tmp_path_factory.mktemp("smg") / "smg.log")
        smg.wait_until_ready(workers=1, model=MODEL, timeout_s=60)
        yield smg
    finally:
        if smg is not None:
            smg.stop()
        if engine.proc.poll() is None:
            engine.terminate()                      # SIGTERM: it drains (slow on a loaded machine)
            try:
                engine.wait(120)
            except subprocess.TimeoutExpired:
                engine.proc.kill()
                engine.proc.wait()
        client.close()


def test_a_generate_until_task_scores_what_the_reference_scores(router, shared_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    results = simple_evaluate(
        model="local-completions",
        model_args=(f"model={MODEL},base_url=http://127.0.0.1:{router.port}/v1/completions,tokenizer_backend=None,"
                    "tokenized_requests=False,num_concurrent=1,max_retries=1"),
        tasks=["ninfer_continue"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    got = results["results"]["ninfer_continue"]["exact_match,none"]
    # the reference: transformers' float32 greedy continuation of each prompt, cut at the first newline
    from engine.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_file(f"{shared_model}/tokenizer.json")
    model = load_reference_model(shared_model)
    hits = 0
    for doc, sample in zip(DOCS, results["samples"]["ninfer_continue"]):
        ids = reference_greedy(model, tokenizer.encode(doc["prompt"]), 24)
        text = tokenizer.decode(ids).split("\n")[0]
        assert sample["resps"][0][0] == text, (doc, sample["resps"])
        hits += text == doc["target"]
    assert got == hits / len(DOCS) and 0 < got < 1
