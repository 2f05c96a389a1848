"""`distengine serve` as a user runs it, for the server tests: a subprocess on a free loopback
port, over HTTP or HTTPS, its output to a pipe or a file; the tiny model it serves."""
from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time

import httpx
import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "test-key"
TEMPLATE = ("{% if greeting is defined %}{{ greeting }} {% endif %}{% for m in messages %}{% if m['role'] == 'robot' %}{{ raise_exception('no robots here') }}{% endif %}"
            "{{ m['role'] }} : {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_served_model(folder: str, chat_template: str | None = TEMPLATE) -> str:
    """The demo's tiny model and word-level tokenizer, with `chat_template` (None: without one)."""
    from transformers import AutoTokenizer

    from launch.demo import build_model
    build_model(folder)
    if chat_template is not None:
        tok = AutoTokenizer.from_pretrained(folder)
        tok.chat_template = chat_template
        tok.save_pretrained(folder)
    return folder


# JSON punctuation, digits, letters and spaces, for the byte-level tokenizer's merges
BYTE_CORPUS = ('{"name": "Ada Lovelace", "age": 36, "colors": ["red", "green", "blue"], "ok": true, "x": null}\n'
               '[1, 2, 3.5, -4, 10, 42, 100, 2024, 0.25, 1e10] {"a": {"b": [{"c": "d"}]}, "e": false}\n'
               "the quick brown fox jumps over the lazy dog. The Quick Brown Fox Jumps Over The Lazy Dog!\n"
               "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 yes no maybe true false\n"
               "user : assistant : system : hello world, answer in JSON please.\n")


def build_byte_level_model(folder: str, chat_template: str | None = TEMPLATE) -> str:
    """The demo's tiny model with a byte-level BPE tokenizer (the 256 byte symbols and a few hundred
    merges), so any text, JSON included, can be spelled; the model's vocabulary is padded past the
    tokenizer's, as real checkpoints often are."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from launch.demo import save_random_model
    specials = ["<pad>", "<eos>", "<bos>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=len(specials) + 256 + 300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([BYTE_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)
    save_random_model(folder, vocab_size=(len(fast) + 63) // 64 * 64, eos_token_id=fast.eos_token_id,
                      bos_token_id=fast.bos_token_id, pad_token_id=fast.pad_token_id)
    return folder


class Server:
    """`ca`: the certificate a server started with --ssl-certfile is trusted by (HTTPS then);
    `log`: a file for its output, to read while it runs (else a pipe, read once it has stopped)."""

    def __init__(self, model: str, *extra: str, ca: str | None = None, log: str | None = None) -> None:
        self.port = free_port()
        self.url = f"{'https' if ca else 'http'}://127.0.0.1:{self.port}"
        self.http = httpx.Client(verify=ssl.create_default_context(cafile=ca) if ca else True, timeout=60)
        env = {**os.environ, "DISTENGINE_API_KEY": KEY, "PYTHONUNBUFFERED": "1"}
        self.log = log
        out = open(log, "w") if log else subprocess.PIPE
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "serve", model, "--device", "cpu",
                                          "--dtype", "float32", "--max-model-len", "256", "--port", str(self.port),
                                          *extra], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        finally:
            if log:
                out.close()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if self.http.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            raise AssertionError("the server did not start")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0,
                                    http_client=self.http if ca else None)

    def output(self) -> str:
        """What it printed: so far with a log file, else all of it once it has stopped."""
        if self.log:
            with open(self.log) as f:
                return f.read()
        return self.proc.stdout.read()

    def post(self, path: str, body, key: str | None = KEY, raw: bool = False, headers: dict | None = None) \
            -> httpx.Response:
        sent = {"Content-Type": "application/json", **(headers or {})}
        if key:
            sent["Authorization"] = f"Bearer {key}"
        return self.http.post(self.url + path, content=body if raw else json.dumps(body), headers=sent)

    def metric(self, name: str, prefix: str = "distengine:") -> float:
        for line in self.http.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(f"{prefix}{name}{{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def wait_idle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.metric("num_requests_running") == 0 and self.metric("kv_cache_usage_perc") == 0:
                return
            time.sleep(0.2)
        raise AssertionError(f"still busy: running {self.metric('num_requests_running')}, "
                             f"KV {self.metric('kv_cache_usage_perc')}")

    def stop(self) -> int:
        self.http.close()  # an idle TLS connection would hold uvicorn's shutdown until its close times out
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
