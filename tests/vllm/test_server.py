"""The real OpenAI-compatible server with ``--quantization zipserv`` answers like the BF16 server.

Two servers on 127.0.0.1 (free ports), started together with
``python -m zipserv_vllm.serve`` (the CPU wheel's ``vllm`` script is broken,
vllm-plugin-notes pitfall 2): the stock BF16 checkpoint as is, and the same
checkpoint with ``--quantization zipserv`` (packed at load), both started the
way a user starts them: no ``--enforce-eager``, so vLLM compiles the model with
Inductor. Both are queried with the ``openai`` client; every answer must be
identical. The same holds for
the embeddings endpoint of a sentence-transformers model and for a mixture of
experts served from its zipserv checkpoint. Servers are stopped in teardown;
every wait is bounded.
"""

from __future__ import annotations

import contextlib

import pytest

from zipserv_vllm import serve
from zs_e2e import e2e_env

READY_TIMEOUT = 240
DEFAULT_ARGS = ("--served-model-name", "tiny", "--max-model-len", "128", "--kv-cache-memory-bytes", str(32 << 20),
                "--seed", "0")  # vLLM's default compilation (Inductor)
SERVER_ARGS = (*DEFAULT_ARGS, "--enforce-eager")


def _wait_ready(proc, port, logpath):
    try:
        serve.wait_ready(proc, port, READY_TIMEOUT)
    except (RuntimeError, TimeoutError) as exc:
        pytest.fail(f"{exc}:\n{logpath.read_text()[-4000:]}")


@contextlib.contextmanager
def _servers(specs: dict, args, logs):
    """Start one server per ``name: (model, extra args)`` together, wait for all, yield their URLs,
    stop them all."""
    procs, ports, files = {}, {}, []
    try:
        for name, (model, extra) in specs.items():
            ports[name] = serve.free_port()
            f = open(logs / f"{name}.log", "w")
            files.append(f)
            procs[name] = serve.start_server(model, ports[name], (*args, *extra), log=f)
        for name in specs:
            _wait_ready(procs[name], ports[name], logs / f"{name}.log")
        yield {n: f"http://127.0.0.1:{p}/v1" for n, p in ports.items()}
    finally:
        for p in procs.values():
            serve.stop_server(p)
        for f in files:
            f.close()


@pytest.fixture(scope="module")
def servers(llama_dirs, tmp_path_factory):
    bf16, _ = llama_dirs
    logs = tmp_path_factory.mktemp("server")
    with contextlib.ExitStack() as stack:
        with e2e_env():  # the servers start with the settings; the module's tests run without them
            urls = stack.enter_context(_servers({"base": (bf16, ()), "zipserv": (bf16, ("--quantization", "zipserv"))},
                                                DEFAULT_ARGS, logs))
        yield urls, logs


def _client(url):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key="EMPTY", timeout=120, max_retries=0)


def _ask(url) -> dict:
    c = _client(url)
    models = [m.id for m in c.models.list().data]
    # One prompt per request, one request at a time: two prompts in one request are batched as
    # their arrival allows, and batch shape changes the GEMM's summation (BF16's too).
    comps = [c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0.0, logprobs=1,
                                  extra_body={"ignore_eos": True}).choices[0]
             for p in ("hello world", "The quick brown fox")]
    stream = c.completions.create(model="tiny", prompt="def forward(self, x):", max_tokens=12, temperature=0.0,
                                  stream=True, extra_body={"ignore_eos": True})
    streamed = "".join(ch.choices[0].text for ch in stream if ch.choices)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is a tile?"}],
                                     max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True})
    return {
        "models": models,
        "texts": [ch.text for ch in comps],
        "logprobs": [ch.logprobs.token_logprobs for ch in comps],
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
    for name in ("base", "zipserv"):  # both compiled by Inductor, as vllm serve does by default
        text = (logs / f"{name}.log").read_text()
        assert "'backend': 'inductor'" in text and "enforce_eager=False" in text, name


def test_embeddings_endpoint_equals_bf16(vllm_env, tmp_path):
    """/v1/embeddings of a sentence-transformers model (2_Dense projection): the pre-compressed
    checkpoint's server gives the BF16 server's vectors."""
    from zipserv_vllm.checkpoint import compress_checkpoint
    from zipserv_vllm.testing.zoo import build_zoo_model

    bf16 = build_zoo_model(tmp_path / "bert", "bert-st")
    zs = compress_checkpoint(bf16, tmp_path / "bert-zs", progress=False).dst
    args = ("--served-model-name", "tiny", "--enforce-eager", "--max-model-len", "128", "--runner", "pooling",
            "--kv-cache-memory-bytes", str(32 << 20))
    out = {}
    with _servers({"base": (bf16, ()), "zipserv": (zs, ())}, args, tmp_path) as urls:
        for name, url in urls.items():
            # one input per request: two inputs in one request may be batched together or not,
            # depending on timing, and a different batch shape rounds differently in vLLM's GEMMs
            # (a fresh-clone CI run once saw the last bits of one element differ)
            client = _client(url)
            out[name] = [client.embeddings.create(model="tiny", input=[text]).data[0].embedding
                         for text in ("hello world", "a lossless format")]
    assert len(out["base"][0]) == 32 and out["zipserv"] == out["base"]


def test_mixture_of_experts_server_answers_equal_bf16_server(vllm_env, tmp_path):
    """A zipserv checkpoint of a Mixtral-style model, served with plain ``vllm serve DIR`` (its
    experts read compressed by tile): completions, logprobs and a streamed completion equal the
    BF16 server's. One prompt per request, as above."""
    from zipserv_vllm.checkpoint import compress_checkpoint
    from zipserv_vllm.testing.zoo import build_zoo_model

    bf16 = build_zoo_model(tmp_path / "mixtral", "mixtral")
    zs = compress_checkpoint(bf16, tmp_path / "mixtral-zs", progress=False).dst
    out = {}
    with _servers({"base": (bf16, ()), "zipserv": (zs, ())}, SERVER_ARGS, tmp_path) as urls:
        for name, url in urls.items():
            c = _client(url)
            comps = [c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0.0, logprobs=1,
                                          extra_body={"ignore_eos": True}).choices[0]
                     for p in ("hello world", "The quick brown fox")]
            stream = c.completions.create(model="tiny", prompt="def forward(self, x):", max_tokens=12,
                                          temperature=0.0, stream=True, extra_body={"ignore_eos": True})
            out[name] = {"texts": [ch.text for ch in comps], "logprobs": [ch.logprobs.token_logprobs for ch in comps],
                         "streamed": "".join(ch.choices[0].text for ch in stream if ch.choices)}
    assert all(out["base"]["texts"]) and out["base"]["streamed"]
    assert out["zipserv"] == out["base"]
    log = (tmp_path / "zipserv.log").read_text()
    assert "mode exact" in log and "layers compressed" in log
