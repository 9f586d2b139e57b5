"""LoRA adapters on a multi-controller pair (two processes x 4 virtual CPU devices, one 8-device
mesh): with max_loras=1 and two adapters, each request's adapter is written into the one device
slot on both processes (process 0 broadcasts the write), and every completion equals
transformers + peft's greedy tokens."""

from __future__ import annotations

import shutil

import httpx
import pytest

from tests.lora.adapters import make_adapters, peft_model, reference_greedy
from tests.multihost.test_lockstep import ENGINE, devices_env, group_args
from tests.server_process import ServerProcess, free_port

PROMPT_IDS = [12, 40, 77, 5, 120, 33, 8]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    made = make_adapters(tiny_model_dir, tmp_path_factory.mktemp("made"))
    root = tmp_path_factory.mktemp("served")
    for name in ("attn-r4", "all-r8"):
        shutil.copytree(made[name], root / name)
    return root, made


def test_a_pair_serves_each_adapter_through_one_device_slot(tiny_model_dir, adapters):
    from serving.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    engine = [
        *(a for a in ENGINE if not a.startswith(("enable_model_warmup", "enable_background_warmup", "liveness_timeout_s"))),
        "enable_model_warmup=false",
        # Without warmup the first requests compile while they wait: on a cold compilation cache and
        # a busy machine that took longer than test_lockstep's 10 s (+ distributed_timeout_s), and
        # process 0's stall watch exited mid-request ("Server disconnected").
        "liveness_timeout_s=300",
    ]
    lora = [f"lora_input_adapters_path={adapters[0]}", "max_loras=1"]
    coordinator = free_port()
    pair = [
        ServerProcess.pathserve(str(tiny_model_dir), *engine, *lora, *group_args(i, coordinator), env=devices_env(4))
        for i in (0, 1)
    ]
    try:
        leader = pair[0].wait_ready()
        for name in ("attn-r4", "all-r8", "attn-r4", None):  # the one slot: attn-r4, all-r8, attn-r4 again
            expected = reference_greedy(peft_model(tiny_model_dir, adapters[1][name] if name else None), PROMPT_IDS,
                                        MAX_TOKENS, tokenizer.vocab_size)
            body = {"prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
            if name:
                body["model"] = name
            answer = httpx.post(f"{leader.url}/v1/completions", json=body, timeout=300)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == tokenizer.decode(expected), name
        assert pair[1].proc.poll() is None  # the follower kept up
    finally:
        for server in pair:
            server.stop()
