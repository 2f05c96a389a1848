"""`distengine serve`'s operational flags, as vLLM's: --chat-template (a model without one chats),
--generation-config (the checkpoint's sampling defaults for the fields a request leaves out),
--enable-log-requests and --max-log-len, CORS, --root-path and TLS, on one server started with
all of them (HTTPS when the `openssl` command can make a certificate); each flag's mistakes, and a
port in use, end the command with status 2 and one line before the engine starts."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("ray")

from tests.server_harness import KEY, ROOT, Server, build_served_model  # noqa: E402

# The model's generation_config.json (beside its token ids): what a request leaving them out gets.
GENERATION = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.1, "max_new_tokens": 5}
# The server's template (the model has none): "who made oil . answer" for one user message.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} . {% endfor %}"
                 "{% if add_generation_prompt %}answer{% endif %}")
LOG_LEN = 8


@pytest.fixture(scope="module")
def options_model(tmp_path_factory) -> str:
    folder = build_served_model(str(tmp_path_factory.mktemp("no-template")), chat_template=None)
    path = os.path.join(folder, "generation_config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **GENERATION}, f)
    return folder


def self_signed_certificate(folder) -> tuple[str, str] | None:
    """(certificate, key) for 127.0.0.1, or None without the `openssl` command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", cert, "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[str, str] | None:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def options_server(options_model, tls, tmp_path_factory):
    folder = tmp_path_factory.mktemp("options")
    template = folder / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    extra = ["--served-model-name", "opt", "--chat-template", str(template), "--enable-log-requests",
             "--max-log-len", str(LOG_LEN), "--allowed-origins", '["http://good.example"]', "--allow-credentials",
             "--root-path", "/api"]
    if tls:
        extra += ["--ssl-certfile", tls[0], "--ssl-keyfile", tls[1]]
    s = Server(options_model, *extra, ca=tls[0] if tls else None, log=str(folder / "server.log"))
    yield s
    assert s.stop() == 0


def _request_line(server: Server, request_id: str) -> str:
    found = [line for line in server.output().splitlines() if f"Received request {request_id}-0-" in line]
    assert len(found) == 1, server.output()
    return found[0]


def test_chat_template_flag_lets_a_model_without_one_chat(options_server):
    s = options_server
    r = s.client.chat.completions.create(model="opt", messages=[{"role": "user", "content": "who made oil"}],
                                         max_tokens=2, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content and r.usage.completion_tokens == 2
    templated = s.post("/tokenize", {"messages": [{"role": "user", "content": "who made oil"}]}).json()
    assert templated["tokens"] == s.post("/tokenize", {"prompt": "who made oil . answer"}).json()["tokens"]
    assert r.usage.prompt_tokens == templated["count"] == 5


def test_generation_config_gives_the_defaults_and_requests_are_logged(options_server):
    """The model's generation_config.json fills the fields a request leaves out (max_new_tokens
    too, for chat; a completion keeps OpenAI's 16, as in vLLM); a field given wins. Each request
    is logged once, its prompt and prompt token ids cut to --max-log-len."""
    s = options_server
    assert ("Using default sampling params from the model's generation_config.json (--generation-config vllm: "
            "none): {'temperature': 0.5, 'top_p': 0.9, 'top_k': 7, 'repetition_penalty': 1.1, 'max_tokens': 5}"
            in s.output())
    msgs = [{"role": "user", "content": "who made oil"}]
    r = s.post("/v1/chat/completions", {"messages": msgs, "ignore_eos": True}, headers={"X-Request-Id": "d1"})
    assert r.json()["usage"]["completion_tokens"] == 5
    line = _request_line(s, "chatcmpl-d1")
    assert "prompt: 'who made'," in line
    assert all(f"{k}={v}" in line for k, v in {**GENERATION, "max_tokens": 5}.items() if k != "max_new_tokens"), line
    assert re.search(r"prompt_token_ids: \[\d+, \d+, \d+, \d+, \d+\]\.$", line), line  # 5 tokens: all of them
    r = s.post("/v1/chat/completions", {"messages": msgs, "ignore_eos": True, "temperature": 0.9, "max_tokens": 3},
               headers={"X-Request-Id": "d2"})
    assert r.json()["usage"]["completion_tokens"] == 3
    line = _request_line(s, "chatcmpl-d2")
    assert "temperature=0.9," in line and "top_p=0.9," in line and "max_tokens=3," in line
    prompt = "what is water and who made the first oil"
    r = s.post("/v1/completions", {"prompt": prompt, "ignore_eos": True}, headers={"X-Request-Id": "d3"})
    assert r.json()["usage"]["completion_tokens"] == 16
    line = _request_line(s, "cmpl-d3")
    assert f"prompt: {prompt[:LOG_LEN]!r}," in line and "max_tokens=16," in line and "temperature=0.5," in line
    ids = json.loads(line.rsplit("prompt_token_ids: ", 1)[1].rstrip("."))
    assert ids == s.post("/tokenize", {"prompt": prompt}).json()["tokens"][:LOG_LEN] and len(ids) == LOG_LEN


def test_cors_origins_from_the_flags(options_server):
    s = options_server
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    r = s.http.options(s.url + "/v1/completions", headers={"Origin": "http://good.example", **preflight})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://good.example"
    assert r.headers["access-control-allow-credentials"] == "true"
    r = s.http.options(s.url + "/v1/completions", headers={"Origin": "http://evil.example", **preflight})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = s.post("/v1/completions", {"prompt": "x", "max_tokens": 1}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_root_path(options_server):
    """Behind a proxy that strips /api: the schema names the prefix, and the API key is still
    asked for on every path the proxy forwards."""
    s = options_server
    assert s.http.get(s.url + "/openapi.json").json()["servers"] == [{"url": "/api"}]
    assert s.http.get(s.url + "/v1/models").status_code == 401
    models = s.http.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "opt"


def test_tls(options_server, tls):
    if tls is None:
        pytest.skip("making a self-signed certificate needs the openssl command")
    s = options_server
    assert s.url.startswith("https://") and f"on https://127.0.0.1:{s.port}/v1" in s.output()
    assert s.http.get(s.url + "/health").status_code == 200  # verified against our certificate
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=10)  # plain HTTP is not served
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health", timeout=10)  # nor is the certificate trusted by default


# ---- the flags' mistakes: status 2 and one line, before the engine starts -----------------------


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


BAD_OPTIONS = [  # (what, flags, message part); {name} is a file or folder of the test's
    ("a chat template file that is not there", ["--chat-template", "/nonexistent/chat.jinja"],
     "--chat-template '/nonexistent/chat.jinja': cannot read the file (No such file or directory)"),
    ("a chat template that does not compile",
     ["--chat-template", "{% for m in messages %}\n{{ m | nofilter }}{% endfor %}"],
     "--chat-template: the template does not compile (line 2: No filter named 'nofilter'"),
    ("a chat template file that does not compile", ["--chat-template", "{bad_template}"],
     "the template does not compile (line 1:"),
    ("a generation config folder that is not there", ["--generation-config", "/nonexistent/gen"],
     "generation_config '/nonexistent/gen' is neither 'auto', 'vllm' nor a folder"),
    ("a generation config folder without the file", ["--generation-config", "{empty}"],
     "holds no generation_config.json"),
    ("a generation config out of range", ["--generation-config", "{bad_generation}"],
     "generation_config.json: top_p: top_p must be in (0, 1]"),
    ("a certificate that is not there", ["--ssl-certfile", "/nonexistent/cert.pem"],
     "--ssl-certfile '/nonexistent/cert.pem': no such file"),
    ("a certificate that is not one", ["--ssl-certfile", "{bad_template}"], "not a PEM certificate"),
    ("a key without a certificate", ["--ssl-keyfile", "{bad_template}"], "need --ssl-certfile"),
    ("a negative log length", ["--max-log-len", "-1"], "--max-log-len must be >= 0, got -1"),
    ("a root path without its slash", ["--root-path", "api"], "--root-path must start with '/'"),
    ("an unknown tool-call parser", ["--enable-auto-tool-choice", "--tool-call-parser", "nope"],
     "--tool-call-parser 'nope' is not a known parser; choose one of ['functiongemma', 'hermes'"),
    ("auto tool choice without a parser", ["--enable-auto-tool-choice"],
     "--enable-auto-tool-choice requires --tool-call-parser"),
]


@pytest.mark.parametrize("case", BAD_OPTIONS, ids=[c[0] for c in BAD_OPTIONS])
def test_bad_flags_exit_2_with_one_line(case, options_model, busy_port, tmp_path, capsys):
    """In this process: each mistake is found before the port (held here) would be, so a check
    that went missing shows as the port's message, not as a server that never ends."""
    from launch.cli import main
    what, flags, message = case
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad_generation").mkdir()
    (tmp_path / "bad_generation" / "generation_config.json").write_text(json.dumps({"top_p": 2}))
    (tmp_path / "bad_template").write_text("{% if %}")
    ours = {f"{{{name}}}": str(tmp_path / name) for name in ("empty", "bad_generation", "bad_template")}
    flags = [ours.get(f, f) for f in flags]
    assert main(["serve", options_model, "--device", "cpu", "--disable-log-stats", "--port", str(busy_port),
                 *flags]) == 2
    out = capsys.readouterr()
    err = out.err.strip()
    assert err.startswith("distengine serve: error: ") and message in err and "\n" not in err, err
    assert " on http" not in out.out


def test_a_list_flag_that_is_not_json_exits_2(capsys):
    from launch.cli import main
    with pytest.raises(SystemExit) as e:
        main(["serve", "m", "--allowed-origins", "http://a.example"])
    assert e.value.code == 2
    assert "argument --allowed-origins: must be a JSON list of strings" in capsys.readouterr().err


def test_a_port_in_use_exits_2_before_the_engine_starts(options_model, busy_port):
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "serve", options_model, "--device", "cpu", "--port",
                           str(busy_port)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"distengine serve: error: 127.0.0.1:{busy_port} is already in use "
                           f"(Address already in use): give another --host or --port\n")
    assert " on http" not in proc.stdout


# ---- the rules behind the flags ----------------------------------------------------------------


def test_chat_template_from_a_file_or_the_text_itself(tmp_path):
    from launch.serve.options import load_chat_template
    path = tmp_path / "t.jinja"
    path.write_text(CHAT_TEMPLATE)
    assert load_chat_template(str(path)) == CHAT_TEMPLATE
    assert load_chat_template(CHAT_TEMPLATE) == CHAT_TEMPLATE
    with pytest.raises(ValueError, match="cannot read the file"):
        load_chat_template(str(tmp_path))  # a folder: no template


def test_chat_without_a_template_is_refused_by_name(options_model):
    from transformers import AutoTokenizer

    from launch.serve.protocol import ChatMessage, chat_prompt
    tok = AutoTokenizer.from_pretrained(options_model)
    msgs = [ChatMessage(role="user", content="who made oil")]
    with pytest.raises(ValueError, match=r"no chat template: give the server one \(--chat-template\)"):
        chat_prompt(tok, msgs)
    assert chat_prompt(tok, msgs, True, CHAT_TEMPLATE) == "who made oil . answer"
    with pytest.raises(ValueError, match="no tokenizer"):
        chat_prompt(None, msgs, True, CHAT_TEMPLATE)


def test_generation_config_sources(options_model, tmp_path):
    from distengine.generation_config import SamplingDefaults, sampling_defaults
    model_defaults = SamplingDefaults(temperature=0.5, top_p=0.9, top_k=7, repetition_penalty=1.1, max_tokens=5)
    assert sampling_defaults("auto", options_model) == model_defaults
    assert sampling_defaults("vllm", options_model) == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text(json.dumps({"min_p": 0.1, "do_sample": True, "top_k": None}))
    assert sampling_defaults(str(tmp_path), options_model) == SamplingDefaults(min_p=0.1)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    with pytest.raises(ValueError, match="max_new_tokens: max_tokens must be at least 1"):
        sampling_defaults(str(tmp_path), options_model)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        sampling_defaults(str(tmp_path), options_model)


def test_sampling_defaults_fill_only_what_a_request_leaves_out():
    from distengine.generation_config import SamplingDefaults
    from launch.serve.protocol import ChatCompletionRequest
    defaults = SamplingDefaults(temperature=0.5, top_k=7, repetition_penalty=1.1)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_k=3, presence_penalty=0.5)
    sp = req.to_sampling_params(4, None, defaults)
    assert (sp.temperature, sp.top_k, sp.repetition_penalty, sp.presence_penalty, sp.top_p, sp.max_tokens) == \
        (0.5, 3, 1.1, 0.5, 1.0, 4)
    neutral = req.to_sampling_params(4, None)
    assert (neutral.temperature, neutral.repetition_penalty) == (1.0, 1.0)
