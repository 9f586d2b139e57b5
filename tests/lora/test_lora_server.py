"""Adapters on a real `pathserve serve` process (the tiny model, lora_input_adapters_path with two
adapters, max_loras=2, an API key): served tokens equal transformers + peft, and adapters are
listed, loaded and unloaded through the `openai` client / httpx and through JetStream's generated
gRPC stubs (jetstream.proto's Decode with lora_adapter_id, multi_lora_decoding.proto's service v1)."""

from __future__ import annotations

import importlib
import shutil
import sys
from types import SimpleNamespace

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.metric_names import LORA_INFO
from tests.lora.adapters import make_adapters, peft_model, reference_greedy
from tests.server_process import REPO, ServerProcess, free_port, metric

KEY = "lora-secret"
MAX_TOKENS = 6
PROMPT_IDS = [12, 40, 77, 5, 120, 33, 8]
AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {KEY}"),)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    made = make_adapters(tiny_model_dir, tmp_path_factory.mktemp("made"))
    served = tmp_path_factory.mktemp("served")  # what the server finds at start-up: two of three
    for name in ("attn-r4", "all-r8"):
        shutil.copytree(made[name], served / name)
    return served, made


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters):
    """name (None: the base model) -> (peft's greedy ids, their text)."""
    from serving.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    out = {}
    for name, path in [*adapters[1].items(), (None, None)]:
        ids = reference_greedy(peft_model(tiny_model_dir, path), PROMPT_IDS, MAX_TOKENS, tokenizer.vocab_size)
        out[name] = (ids, tokenizer.decode(ids))
    return out


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters):
    grpc_port = free_port()
    process = ServerProcess.pathserve(
        str(tiny_model_dir),
        "per_device_batch_size=4",
        "max_prefill_predict_length=64",
        "max_target_length=256",
        "enable_model_warmup=false",  # as before the serving profile applied to any model
        f"lora_input_adapters_path={adapters[0]}",
        "max_loras=2",
        f"grpc_port={grpc_port}",
        env={"PATHSERVE_API_KEY": KEY},
    ).wait_ready()
    process.grpc_address = f"127.0.0.1:{grpc_port}"
    yield process
    process.stop()


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    """Both protos compiled the way a JetStream user does (top-level modules)."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("lora-stubs")
    protos = REPO / "serving" / "grpc"
    for name in ("jetstream.proto", "multi_lora_decoding.proto"):
        args = ["protoc", f"-I{protos}", f"--python_out={out}", f"--grpc_python_out={out}", str(protos / name)]
        assert protoc.main(args) == 0
    sys.path.insert(0, str(out))
    try:
        modules = ("jetstream_pb2", "jetstream_pb2_grpc", "multi_lora_decoding_pb2", "multi_lora_decoding_pb2_grpc")
        return SimpleNamespace(**{m: importlib.import_module(m) for m in modules})
    finally:
        sys.path.remove(str(out))


def _completion(server, model: str) -> str:
    """Greedy text after PROMPT_IDS under `model`, through the openai client."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    out = client.completions.create(
        model=model, prompt=PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.model == model and out.usage.completion_tokens == MAX_TOKENS
    return out.choices[0].text


def test_openai_model_names_an_adapter_and_models_lists_them(server, expected):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    models = {m.id: m for m in client.models.list().data}
    base = next(m for m in models.values() if getattr(m, "parent", None) is None).id
    assert set(models) == {base, "attn-r4", "all-r8"}
    assert models["attn-r4"].parent == base
    assert _completion(server, "attn-r4") == expected["attn-r4"][1]
    assert _completion(server, "all-r8") == expected["all-r8"][1]
    assert _completion(server, base) == expected[None][1]
    assert len({expected[n][1] for n in ("attn-r4", "all-r8", None)}) == 3
    chat = client.chat.completions.create(model="all-r8", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.model == "all-r8"


def test_load_and_unload_over_http_behind_the_api_key(server, adapters, expected):
    # Make the two start-up adapters resident first, whatever ran before (or not): with
    # max_loras=2, loading and using a third then leaves exactly two resident.
    for name in ("attn-r4", "all-r8"):
        assert _completion(server, name) == expected[name][1]
    path = str(adapters[1]["mlp-r16-rs"])
    body = {"lora_name": "mlp-r16-rs", "lora_path": path}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=body).status_code == 401
    answer = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=AUTH).status_code == 400  # loaded
    listed = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]
    assert {m["id"] for m in listed if m.get("parent")} == {"attn-r4", "all-r8", "mlp-r16-rs"}
    assert _completion(server, "mlp-r16-rs") == expected["mlp-r16-rs"][1]
    statuses = {m["id"]: m["status"] for m in httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"] if m.get("parent")}
    assert list(statuses.values()).count("resident") == 2  # max_loras=2: one of the three is not

    scraped = httpx.get(f"{server.url}/metrics").text
    assert metric(server, "pathserve_lora_adapters_loaded") == 3
    assert metric(server, "pathserve_lora_adapters_resident") == 2
    assert metric(server, "pathserve_lora_loads_total") >= 3 and metric(server, "pathserve_lora_load_seconds_total") > 0
    assert metric(server, "pathserve_lora_requests_total", '{adapter="mlp-r16-rs"}') == 1, scraped
    # The model-server protocol's LoRA info gauge names the two resident adapters.
    (info,) = next(f for f in text_string_to_metric_families(scraped) if f.name == LORA_INFO).samples
    resident = {name for name, status in statuses.items() if status == "resident"}
    assert info.labels["max_lora"] == "2" and set(info.labels["running_lora_adapters"].split(",")) == resident
    assert info.labels["waiting_lora_adapters"] == "" and info.value > 0

    gone = {"lora_name": "mlp-r16-rs"}
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json=gone, headers=AUTH).status_code == 200
    again = httpx.post(f"{server.url}/v1/unload_lora_adapter", json=gone, headers=AUTH)
    assert again.status_code == 404 and "mlp-r16-rs" in again.json()["error"]["message"]
    request = {"model": "mlp-r16-rs", "prompt": "hello", "max_tokens": 2}
    refused = httpx.post(f"{server.url}/v1/completions", json=request, headers=AUTH)
    assert refused.status_code == 404 and "mlp-r16-rs" in refused.json()["error"]["message"]
    bad = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"}, headers=AUTH)
    assert bad.status_code == 400 and "/nowhere" in bad.json()["error"]["message"]


def test_jetstream_stubs_decode_list_load_and_unload(server, stubs, adapters, expected):
    pb, pb_grpc = stubs.jetstream_pb2, stubs.jetstream_pb2_grpc
    lora, lora_grpc = stubs.multi_lora_decoding_pb2, stubs.multi_lora_decoding_pb2_grpc
    with grpc.insecure_channel(server.grpc_address) as channel:
        decode, service = pb_grpc.OrchestratorStub(channel).Decode, lora_grpc.v1Stub(channel)

        def tokens(adapter: str) -> list[int]:
            request = pb.DecodeRequest(
                max_tokens=MAX_TOKENS, token_content=pb.DecodeRequest.TokenContent(token_ids=PROMPT_IDS),
                has_bos=True, lora_adapter_id=adapter,
            )
            return [i for r in decode(request, metadata=GRPC_AUTH) for s in r.stream_content.samples for i in s.token_ids]

        with pytest.raises(grpc.RpcError) as info:
            service.models(lora.ListAdaptersRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        listed = service.models(lora.ListAdaptersRequest(), metadata=GRPC_AUTH)
        assert listed.success and {a.adapter_id for a in listed.adapter_infos} >= {"attn-r4", "all-r8"}
        assert {a.status for a in listed.adapter_infos} <= {"loaded_hbm", "loaded_cpu", "unloaded"}

        path = str(adapters[1]["mlp-r16-rs"])
        loaded = service.load_lora_adapter(lora.LoadAdapterRequest(adapter_id="rs", adapter_path=path), metadata=GRPC_AUTH)
        assert loaded.success
        for name, adapter in (("mlp-r16-rs", "rs"), ("attn-r4", "attn-r4"), (None, "")):
            got = tokens(adapter)  # greedy, ending early at an end-of-sequence id
            assert got and got == expected[name][0][: len(got)], name
        infos = {a.adapter_id: a for a in service.models(lora.ListAdaptersRequest(), metadata=GRPC_AUTH).adapter_infos}
        assert infos["attn-r4"].status == "loaded_hbm" and infos["attn-r4"].loading_cost == 0
        assert infos["attn-r4"].size_hbm > 0

        assert service.unload_lora_adapter(lora.UnloadAdapterRequest(adapter_id="rs"), metadata=GRPC_AUTH).success
        for call in (
            lambda: service.unload_lora_adapter(lora.UnloadAdapterRequest(adapter_id="rs"), metadata=GRPC_AUTH),
            lambda: tokens("rs"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.NOT_FOUND and "rs" in info.value.details()
