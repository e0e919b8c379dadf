"""Real models through the whole mesh, started like ``make up``:

- a random Qwen3 checkpoint written by transformers (q/k norm, explicit head_dim) served by ``slicesched up``
  gives transformers' greedy tokens exactly (token ids read back with vLLM's ``return_tokens_as_token_ids``);
- the default configuration (configs/cluster.yaml + configs/tenants.yaml: SmolLM2-135M-Instruct) answers the
  README's chat example in English, and the official ``openai`` client streams a chat answer with content.
"""
from __future__ import annotations

import json
import urllib.request

import pytest
import torch
import yaml

from support.mesh import REPO, start_mesh, stop_mesh

pytestmark = pytest.mark.e2e
KEY = "sk-test-qwen3-0001"


def post(base: str, path: str, body: dict, key: str, timeout: float = 120) -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def qwen3_mesh(tmp_path_factory):
    pytest.importorskip("transformers")
    import sys
    sys.path.insert(0, str(REPO / "tests" / "unit" / "model"))
    from hf_reference import make_checkpoint

    tmp = tmp_path_factory.mktemp("qwen3")
    ck, ref = make_checkpoint("qwen3", tmp / "ck", seed=11)
    (tmp / "cluster.yaml").write_text(yaml.safe_dump({"cluster": {"name": "one"}, "devices": [
        {"id": "cpu0", "backend": "cpu", "kind": "cpu", "memory_gb": 0.25, "threads": 1}]}))
    (tmp / "tenants.yaml").write_text(yaml.safe_dump({"tenants": [
        {"name": "q3", "model": {"checkpoint": str(ck)}, "sla": {"ttft_ms": 5000, "tpot_ms": 500},
         "home_devices": ["cpu0"], "api_keys": [KEY]}]}))
    m = start_mesh(tmp / "mesh", extra_args=["--cluster", str(tmp / "cluster.yaml"),
                                             "--tenants", str(tmp / "tenants.yaml")])
    try:
        yield m, ref
    finally:
        stop_mesh(m)


def test_a_transformers_qwen3_checkpoint_gives_its_greedy_tokens_through_the_mesh(qwen3_mesh):
    import sys
    sys.path.insert(0, str(REPO / "tests" / "unit" / "model"))
    from hf_reference import hf_greedy

    mesh, ref = qwen3_mesh
    g = torch.Generator().manual_seed(3)
    for n in (17, 4):
        prompt = torch.randint(3, ref.config.vocab_size, (n,), generator=g).tolist()
        body = post(mesh.gateway, "/v1/completions", {"model": "q3", "prompt": prompt, "max_tokens": 24,
                                                      "temperature": 0, "ignore_eos": True, "logprobs": 0,
                                                      "return_tokens_as_token_ids": True}, KEY)
        got = [int(t.split(":", 1)[1]) for t in body["choices"][0]["logprobs"]["tokens"]]
        assert got == hf_greedy(ref, prompt, 24)
        assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 24, "total_tokens": n + 24}


@pytest.fixture(scope="module")
def default_mesh(tmp_path_factory):
    m = start_mesh(tmp_path_factory.mktemp("smol"), extra_args=[
        "--cluster", str(REPO / "configs" / "cluster.yaml"), "--tenants", str(REPO / "configs" / "tenants.yaml")])
    try:
        yield m
    finally:
        stop_mesh(m)


def test_the_default_tenants_answer_in_english(default_mesh):
    from shared.config import dev_api_keys
    keys = dev_api_keys(REPO / "configs" / "tenants.yaml")
    body = post(default_mesh.gateway, "/v1/chat/completions", {
        "model": "smol-a", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32, "temperature": 0}, keys["smol-a"][0])
    assert body["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert body["choices"][0]["finish_reason"] == "stop"


def test_the_openai_client_streams_a_chat_answer(default_mesh):
    openai = pytest.importorskip("openai")
    from shared.config import dev_api_keys
    key = dev_api_keys(REPO / "configs" / "tenants.yaml")["smol-b"][0]
    client = openai.OpenAI(base_url=default_mesh.gateway + "/v1", api_key=key, max_retries=0, timeout=120)
    stream = client.chat.completions.create(model="smol-b", messages=[
        {"role": "user", "content": "Name three colors of the rainbow."}], max_tokens=32, stream=True,
        temperature=0.7, seed=1)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    text = "".join(pieces)
    assert sum(1 for p in pieces if p) >= 3 and text.strip(), pieces
    assert any(c in text.lower() for c in ("red", "orange", "yellow", "green", "blue", "indigo", "violet")), text
