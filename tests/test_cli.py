"""The command line: `--help` and `--version` without torch; every option has help text (and
argparse shows its default); user errors end with one line on stderr and exit status 2, `--debug`
shows the traceback; `generate` runs a model without a tokenizer from token ids, or with
`--tokenizer`; the demo keeps its model under the user's cache folder and shows its plan."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from launch.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_and_version_without_torch():
    code = ("import sys; from launch.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "assert 'torch' not in sys.modules and 'ray' not in sys.modules, sorted(sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "generate" in run.stdout and "bench" in run.stdout
    run = subprocess.run([sys.executable, "-m", "launch.cli", "--version"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and run.stdout.startswith("distengine ")


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_has_help():
    missing = [f"{p.prog} {'/'.join(a.option_strings)}" for p in _parsers(build_parser()) for a in p._actions
               if a.option_strings and a.help in (None, "") and not isinstance(a, argparse._HelpAction)]
    assert not missing, missing


@pytest.fixture(scope="module")
def no_tokenizer_model(tmp_path_factory):
    from launch.bench.common import build_random_model
    folder = str(tmp_path_factory.mktemp("tiny"))
    build_random_model(folder, "tiny", "cpu")  # config and weights, no tokenizer files
    return folder


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "/nonexistent/model", "--prompt", "hi"], "does not exist"),
    (["kv-plan", "--config", "nope"], "neither a config.json"),
    (["generate", "--model", "{tiny}", "--prompt", "hi"], "no tokenizer: give --tokenizer, or prompts as --prompt-token-ids"),
    (["generate", "--model", "{tiny}", "--prompt-token-ids", "1,2", "--temperature", "-1"], "temperature"),
    (["generate", "--model", "{tiny}", "--prompt-token-ids", "1,99999"], "is not a token id"),
    (["generate", "--model", "{tiny}", "--prompt-token-ids", "1,2", "--max-model-len", "999999"], "max_model_len"),
    (["bench", "kvcache", "--reference", "vllm", "--requests", "3"], "vLLM is not installed"),
])
def test_user_errors_are_one_line_and_status_2(argv, message, no_tokenizer_model, capsys):
    pytest.importorskip("ray")
    if "vllm" in argv:
        try:
            import vllm  # noqa: F401
            pytest.skip("vLLM is installed here")
        except ImportError:
            pass
    argv = [a.replace("{tiny}", no_tokenizer_model) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith(f"distengine {argv[0]}") and "\n" not in err, err
    with pytest.raises(Exception):
        main(["--debug"] + argv)


def test_argument_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "x", "--prompt-token-ids", "1,x"])
    assert e.value.code == 2 and "token ids are integers" in capsys.readouterr().err


def test_generate_from_token_ids_and_with_a_tokenizer(no_tokenizer_model, tmp_path, capsys):
    assert main(["generate", "--model", no_tokenizer_model, "--device", "cpu", "--prompt-token-ids", "5 6 7",
                 "--prompt-token-ids", "8,9", "--max-tokens", "3", "--seed", "1", "--top-k", "5", "--top-p", "0.9",
                 "--temperature", "0.8", "--dtype", "float32", "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- token ids") == 2 and out.count("token ids [") == 4
    from launch.demo import build_model
    tok = tmp_path / "tok"
    build_model(str(tok))  # its tokenizer; the tiny model has no tokenizer of its own
    assert main(["generate", "--model", no_tokenizer_model, "--tokenizer", str(tok), "--device", "cpu",
                 "--prompt", "what is water", "--max-tokens", "2", "--max-model-len", "64"]) == 0
    assert "--- 'what is water'" in capsys.readouterr().out


def test_demo_keeps_its_model_in_the_cache_and_shows_the_plan(tmp_path, monkeypatch, capsys):
    from launch.demo import default_model_dir
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = default_model_dir()
    assert folder.startswith(str(tmp_path / "distengine" / "demo-model-"))
    assert main(["demo", "--tp", "1", "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert os.path.exists(os.path.join(folder, "config.json"))
    assert "group 0: full_attention" in out and "sliding_window(window=16)" in out
    assert "whole blocks of 16 tokens" in out and "per rank" in out
    assert main(["demo", "--tp", "1", "--max-tokens", "2"]) == 0  # reused, not rebuilt
    assert "building the tiny model" not in capsys.readouterr().out
