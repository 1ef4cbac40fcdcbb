"""``python -m zipserv_vllm.serve`` arguments: a positional model, and 127.0.0.1 unless asked otherwise."""

from zipserv_vllm.serve import _argv


def test_model_and_default_host():
    assert _argv(["m"]) == ["--model", "m", "--host", "127.0.0.1"]
    assert _argv(["m", "--host", "0.0.0.0", "--port", "1"]) == ["--model", "m", "--host", "0.0.0.0", "--port", "1"]
    assert _argv(["--model", "m", "--host=::"]) == ["--model", "m", "--host=::"]
