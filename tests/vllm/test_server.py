"""The real OpenAI-compatible server with ``--quantization zipserv`` answers like the BF16 server.

Two servers on 127.0.0.1 (free ports), started together with
``python -m zipserv_vllm.serve`` (the CPU wheel's ``vllm`` script is broken,
vllm-plugin-notes pitfall 2): the stock BF16 checkpoint as is, and the same
checkpoint with ``--quantization zipserv`` (packed at load). Both are queried
with the ``openai`` client; every answer must be identical. Servers are
stopped in the fixture's teardown; every wait is bounded.
"""

from __future__ import annotations

import pytest

from zipserv_vllm import serve

READY_TIMEOUT = 240
SERVER_ARGS = ("--served-model-name", "tiny", "--enforce-eager", "--max-model-len", "128",
               "--kv-cache-memory-bytes", str(32 << 20), "--seed", "0")


def _wait_ready(proc, port, logpath):
    try:
        serve.wait_ready(proc, port, READY_TIMEOUT)
    except (RuntimeError, TimeoutError) as exc:
        pytest.fail(f"{exc}:\n{logpath.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def servers(vllm_env, llama_dirs, tmp_path_factory):
    bf16, _ = llama_dirs
    logs = tmp_path_factory.mktemp("server")
    specs = {"base": (bf16, ()), "zipserv": (bf16, ("--quantization", "zipserv"))}
    procs, ports, files = {}, {}, []
    try:
        for name, (model, extra) in specs.items():
            ports[name] = serve.free_port()
            f = open(logs / f"{name}.log", "w")
            files.append(f)
            procs[name] = serve.start_server(model, ports[name], (*SERVER_ARGS, *extra), log=f)
        for name in specs:
            _wait_ready(procs[name], ports[name], logs / f"{name}.log")
        yield {n: f"http://127.0.0.1:{p}/v1" for n, p in ports.items()}, logs
    finally:
        for p in procs.values():
            serve.stop_server(p)
        for f in files:
            f.close()


def _client(url):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key="EMPTY", timeout=120, max_retries=0)


def _ask(url) -> dict:
    c = _client(url)
    models = [m.id for m in c.models.list().data]
    comp = c.completions.create(model="tiny", prompt=["hello world", "The quick brown fox"], max_tokens=12,
                                temperature=0.0, logprobs=1, extra_body={"ignore_eos": True})
    stream = c.completions.create(model="tiny", prompt="def forward(self, x):", max_tokens=12, temperature=0.0,
                                  stream=True, extra_body={"ignore_eos": True})
    streamed = "".join(ch.choices[0].text for ch in stream if ch.choices)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is a tile?"}],
                                     max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True})
    return {
        "models": models,
        "texts": [ch.text for ch in sorted(comp.choices, key=lambda ch: ch.index)],
        "logprobs": [ch.logprobs.token_logprobs for ch in sorted(comp.choices, key=lambda ch: ch.index)],
        "streamed": streamed,
        "chat": chat.choices[0].message.content,
    }


def test_server_answers_equal_bf16_server(servers):
    urls, logs = servers
    base, zs = _ask(urls["base"]), _ask(urls["zipserv"])
    assert base["models"] == zs["models"] == ["tiny"]
    assert all(base["texts"]) and base["streamed"] and base["chat"]
    assert zs["texts"] == base["texts"]
    assert zs["logprobs"] == base["logprobs"]
    assert zs["streamed"] == base["streamed"]
    assert zs["chat"] == base["chat"]
    log = (logs / "zipserv.log").read_text()
    assert "zipserv: 10 layers compressed (10 packed at load)" in log and "mode exact" in log


def test_embeddings_endpoint_equals_bf16(vllm_env, tmp_path):
    """/v1/embeddings of a sentence-transformers model (2_Dense projection): the pre-compressed
    checkpoint's server gives the BF16 server's vectors."""
    from zipserv_vllm.checkpoint import compress_checkpoint
    from zipserv_vllm.testing.zoo import build_zoo_model

    bf16 = build_zoo_model(tmp_path / "bert", "bert-st")
    zs = compress_checkpoint(bf16, tmp_path / "bert-zs", progress=False).dst
    args = ("--served-model-name", "tiny", "--enforce-eager", "--max-model-len", "128", "--runner", "pooling",
            "--kv-cache-memory-bytes", str(32 << 20))
    procs, ports, files = {}, {}, []
    try:
        for name, model in (("base", bf16), ("zipserv", zs)):
            ports[name] = serve.free_port()
            files.append(open(tmp_path / f"{name}.log", "w"))
            procs[name] = serve.start_server(model, ports[name], args, log=files[-1])
        for name in procs:
            _wait_ready(procs[name], ports[name], tmp_path / f"{name}.log")
        out = {}
        for name, port in ports.items():
            # one input per request: two inputs in one request may be batched together or not,
            # depending on timing, and a different batch shape rounds differently in vLLM's GEMMs
            # (a fresh-clone CI run once saw the last bits of one element differ)
            client = _client(f"http://127.0.0.1:{port}/v1")
            out[name] = [client.embeddings.create(model="tiny", input=[text]).data[0].embedding
                         for text in ("hello world", "a lossless format")]
    finally:
        for p in procs.values():
            serve.stop_server(p)
        for f in files:
            f.close()
    assert len(out["base"][0]) == 32 and out["zipserv"] == out["base"]
