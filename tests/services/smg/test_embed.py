"""Embeddings: a tiny random Qwen3 embedding checkpoint laid out as Qwen3-Embedding is published
(config.json naming Qwen3ForCausalLM, bare-transformer tensors without `model.` or lm_head, and the
sentence-transformers pipeline modules.json -> 1_Pooling (last token) -> Normalize). LLM.embed and the
VllmEngine `Embed` RPC equal transformers' last-token hidden state, L2-normalised; a generative model
answers UNIMPLEMENTED with a message that says why, logging no error and no traceback; /v1/embeddings
through the real smg router returns the same vector."""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
import pytest
import structlog
import torch
from smg_grpc_proto.generated import vllm_engine_pb2 as pb, vllm_engine_pb2_grpc

from engine.config import EngineConfig
from engine.errors import UnsupportedError
from services.engine_host import EngineHost
from services.server.grpc_server import ServerOptions
from tests.conftest import RANDOM_HF_CONFIG, assert_kv_idle, make_llm

PROMPTS = [[5, 17, 99, 3, 250, 0], list(range(10, 60)), [7]]


def build_embedding_checkpoint(path: Path, bare: bool, normalize: bool = True, seed: int = 3):
    """Random-init a transformers Qwen3 (every weight random), saved as an embedding checkpoint.
    -> the float32 transformers Qwen3Model whose last hidden state is the reference."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    from engine.loading.embedded_model import build_default_tokenizer
    cfg = Qwen3Config(**{**RANDOM_HF_CONFIG, "tie_word_embeddings": True})
    torch.manual_seed(seed)
    full = Qwen3ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if p.dim() == 1
                    else torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
    path.mkdir(parents=True, exist_ok=True)
    (full.model if bare else full).save_pretrained(path, safe_serialization=True)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]                     # as Qwen3-Embedding's config says
    (path / "config.json").write_text(json.dumps(config))
    build_default_tokenizer().inner.save(str(path / "tokenizer.json"))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": cfg.hidden_size, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True}))
    return full.model


def reference(model, ids: list[int], normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        last = model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(last, dim=0) if normalize else last


@pytest.fixture(scope="module")
def bare_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-embedding")
    return path, build_embedding_checkpoint(path, bare=True)


@pytest.mark.parametrize("bare,normalize", [(True, True), (False, True), (True, False)])
def test_llm_embed_equals_the_last_hidden_state_of_transformers(tmp_path, bare, normalize):
    model = build_embedding_checkpoint(tmp_path / "ckpt", bare, normalize)
    llm = make_llm(str(tmp_path / "ckpt"), prefill_chunk=16)          # chunked: the last piece pools
    outs = llm.embed(PROMPTS)
    for ids, out in zip(PROMPTS, outs):
        got = torch.tensor(out.outputs.embedding)
        want = reference(model, ids, normalize)
        assert out.prompt_token_ids == ids and got.shape == (RANDOM_HF_CONFIG["hidden_size"],)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        if normalize:
            assert abs(float(got.norm()) - 1.0) < 1e-5
    assert llm.engine.info().embedding
    assert_kv_idle(llm.engine)


def test_llm_embed_of_a_generative_model_says_why(llm_k0):
    with pytest.raises(UnsupportedError, match="generative model.*modules.json.*Qwen3-Embedding"):
        llm_k0.embed(["hello"])
    assert_kv_idle(llm_k0.engine)


@pytest.fixture(scope="module")
def hosts(bare_checkpoint, shared_model):
    path, _ = bare_checkpoint
    embedder = EngineHost(EngineConfig(model=str(path), dtype="float32", kv_capacity=1024),
                          ServerOptions(listen="127.0.0.1:0")).start().load()
    generator = EngineHost(EngineConfig(model=shared_model, dtype="float32", kv_capacity=1024),
                           ServerOptions(listen="127.0.0.1:0")).start().load()
    yield embedder, generator
    embedder.stop()
    generator.stop()


def _stub(host):
    return vllm_engine_pb2_grpc.VllmEngineStub(grpc.insecure_channel(host.address))


def test_embed_rpc_returns_the_normalised_last_hidden_state(hosts, bare_checkpoint):
    embedder, _ = hosts
    stub = _stub(embedder)
    _, model = bare_checkpoint
    for i, ids in enumerate(PROMPTS):
        resp = stub.Embed(pb.EmbedRequest(request_id=f"emb-{i}", tokenized=pb.TokenizedInput(input_ids=ids)),
                          timeout=60)
        assert resp.prompt_tokens == len(ids) and resp.embedding_dim == RANDOM_HF_CONFIG["hidden_size"]
        torch.testing.assert_close(torch.tensor(list(resp.embedding)), reference(model, ids), atol=1e-4, rtol=1e-4)
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert not info.is_generation
    embedder.loop.call(assert_kv_idle)


def test_embed_rpc_of_a_generative_model_is_unimplemented_without_a_traceback(hosts):
    _, generator = hosts
    stub = _stub(generator)
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(grpc.RpcError) as e:
            stub.Embed(pb.EmbedRequest(request_id="e", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7])), timeout=30)
    assert e.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert "generative model" in e.value.details() and "Qwen3-Embedding" in e.value.details()
    assert not [entry for entry in logs if entry.get("log_level") in ("error", "critical") or "exc_info" in entry]
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).is_generation
    generator.loop.call(assert_kv_idle)


def test_embed_rpc_refuses_bad_token_ids(hosts):
    embedder, _ = hosts
    with pytest.raises(grpc.RpcError) as e:
        _stub(embedder).Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[1, 10**6])), timeout=30)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "tokenized.input_ids" in e.value.details()


def test_v1_embeddings_through_the_real_smg_router(bare_checkpoint, tmp_path_factory):
    """The openai SDK's embeddings call through `smg launch` to a `ninfer engine` process serving the
    embedding checkpoint: smg tokenizes, calls Embed, and returns our vector as it is."""
    openai = pytest.importorskip("openai", reason="the test extra installs the openai SDK")
    from tokenizers import Tokenizer

    from tools.serving.server_process import ServerProcess
    from tools.serving.smg_stack import SmgRouter, smg_command
    if smg_command() is None:
        pytest.skip("smg is not installed (the `test` extra installs it)")
    path, model = bare_checkpoint
    engine = ServerProcess.start("engine", "--model", str(path), "--kv-capacity", "1024",
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
    router = None
    try:
        router = SmgRouter.start([engine.address], str(path), tmp_path_factory.mktemp("smg-embed") / "smg.log")
        router.wait_until_ready(workers=1, model=path.name, timeout_s=60)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{router.port}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        text = "the quick brown fox"
        r = client.embeddings.create(model=path.name, input=text)
        ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids
        assert r.usage.prompt_tokens == len(ids)
        torch.testing.assert_close(torch.tensor(r.data[0].embedding), reference(model, ids), atol=1e-4, rtol=1e-4)
    finally:
        if router is not None:
            router.stop()
        engine.terminate()
        engine.wait(30)
