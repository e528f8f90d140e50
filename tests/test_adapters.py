"""Fine-tuned adapters (`--adapter`): mlx-lm's own replies, the model's identity, bad input."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from adapters import mlx_lm_reply, write_adapter
from cli_run import run as run_cli
from tinymodel import write_tiny_gguf

from mlxcache.cache.base import NoCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.errors import AdapterError
from mlxcache.model import LoadedModel, load
from mlxcache.model.adapter import check_adapter
from mlxcache.runtime import make_cache
from mlxcache.sampling import SamplingParams

PROMPT = [5, 17, 99, 3, 42, 42, 8, 150, 61, 7, 200, 11]
GREEDY = SamplingParams(max_tokens=8)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=11)


@pytest.fixture(scope="module")
def lora(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_adapter(tiny.path, tmp_path_factory.mktemp("lora") / "adapter")


def reply(loaded: LoadedModel, params: SamplingParams) -> list[int]:
    result = Engine(loaded, NoCache(loaded.model, 4)).complete(Request(PROMPT, params))
    assert result.tokens and (len(result.tokens) == params.max_tokens or result.stop_token)
    return result.tokens


@pytest.mark.parametrize("kind", ["lora", "dora", "full"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_reply_with_an_adapter_is_mlx_lms_own(
    kind: str, params: SamplingParams, tiny: LoadedModel, tmp_path: Path
) -> None:
    adapter = write_adapter(tiny.path, tmp_path / kind, kind, seed=3)
    loaded = load(str(tiny.path), adapter=adapter)
    got = reply(loaded, params)
    assert got == mlx_lm_reply(tiny.path, adapter, PROMPT, params)[: len(got)]
    # ... and the adapter changes the reply (a test with a no-op adapter proves nothing).
    assert got != mlx_lm_reply(tiny.path, None, PROMPT, params)[: len(got)]


def test_an_adapter_works_on_a_converted_gguf(
    tiny_gguf: Path, tiny: LoadedModel, lora: Path
) -> None:
    """The GGUF is converted to an mlx-lm folder; the adapter applies to that folder as
    mlx-lm's `load(folder, adapter_path=)` applies it."""
    loaded = load(str(tiny_gguf), adapter=lora)
    assert loaded.path == tiny.path
    got = reply(loaded, GREEDY)
    assert got == mlx_lm_reply(tiny.path, lora, PROMPT, GREEDY)[: len(got)]


def test_the_adapter_is_part_of_the_key(tiny: LoadedModel, lora: Path, tmp_path: Path) -> None:
    other = write_adapter(tiny.path, tmp_path / "other", seed=5)
    keys = {
        load(str(tiny.path)).key,
        load(str(tiny.path), adapter=lora).key,
        load(str(tiny.path), adapter=other).key,
    }
    assert len(keys) == 3
    assert load(str(tiny.path)).key == tiny.key  # a plain model's key is what it was
    copy = shutil.copytree(lora, tmp_path / "copy")  # the content, not the path, is the key
    assert load(str(tiny.path), adapter=copy).key == load(str(tiny.path), adapter=lora).key


def test_a_base_models_entries_are_never_resumed_under_an_adapter(
    tiny: LoadedModel, lora: Path, tmp_path: Path
) -> None:
    config = CacheConfig(block_size=4, directory=tmp_path)
    base = Engine(tiny, make_cache(tiny, config))
    base.complete(Request(PROMPT, GREEDY))
    adapted = load(str(tiny.path), adapter=lora)
    engine = Engine(adapted, make_cache(adapted, config))
    first = engine.complete(Request(PROMPT, GREEDY))
    assert first.stats.cached_tokens == 0
    again = Engine(adapted, make_cache(adapted, config)).complete(Request(PROMPT, GREEDY))
    assert again.stats.cached_tokens > 0  # its own entries resume (from the disk tier)
    assert again.tokens == first.tokens == reply(adapted, GREEDY)
    code, out, _ = run_cli("cache", "ls", "--cache-dir", str(tmp_path), "--json")
    models = {row["model"] for row in json.loads(out)}
    assert adapted.adapter is not None and code == 0
    assert models == {
        tiny.name,
        f"{adapted.name} (adapter {lora.name}@{adapted.adapter.digest[:12]})",
    }


def _damaged(folder: Path) -> None:
    data = (folder / "adapters.safetensors").read_bytes()
    (folder / "adapters.safetensors").write_bytes(data[: len(data) // 2])


def _no_config(folder: Path) -> None:
    (folder / "adapter_config.json").unlink()


def _unsupported(folder: Path) -> None:
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "ia3"}))


BAD = {
    "missing folder": (None, "adapter folder not found"),
    "no config": (_no_config, "not an mlx-lm adapter (no adapter_config.json)"),
    "damaged weights": (_damaged, "damaged adapters.safetensors"),
    "unsupported type": (_unsupported, "fine-tune type 'ia3' is not supported"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_adapter_is_one_line_and_exit_2(
    case: str, tiny: LoadedModel, lora: Path, tmp_path: Path
) -> None:
    spoil, said = BAD[case]
    folder = tmp_path / "adapter"
    if spoil is not None:
        shutil.copytree(lora, folder)
        spoil(folder)
    with pytest.raises(AdapterError, match=said.replace("(", r"\(").replace(")", r"\)")):
        load(str(tiny.path), adapter=folder)
    cache = tmp_path / "cache"
    args = ["-m", str(tiny.path), "--adapter", str(folder), "--cache-dir", str(cache)]
    code, out, err = run_cli("generate", *args, "-n", "2", "hi")
    assert (code, out) == (2, "")
    assert said in err and len(err.strip().splitlines()) == 1
    assert not (cache / "kv").exists() or not any((cache / "kv").rglob("*.safetensors"))


def test_an_adapter_for_another_base_is_refused(
    tmp_path: Path, lora: Path, cache_root: Path
) -> None:
    """Trained for a model of other shapes: one line naming the first tensor that differs."""
    write_tiny_gguf(tmp_path / "wide.gguf", hidden=96)  # same layer names, other shapes
    with pytest.raises(AdapterError, match=r"does not fit model wide\.gguf .*shape"):
        load(str(tmp_path / "wide.gguf"), adapter=lora, cache_root=cache_root)


def test_an_adapter_for_another_architecture_is_refused(recurrent: LoadedModel, lora: Path) -> None:
    with pytest.raises(AdapterError, match="not an adapter parameter in the model"):
        load(str(recurrent.path), adapter=lora)


def test_a_golden_records_its_adapter_and_another_adapter_is_the_cause(
    tiny: LoadedModel, lora: Path, tmp_path: Path
) -> None:
    """A suite's `adapter:` runs every case with it and the golden records it; checked with
    another adapter, each case says so first, its outputs not compared."""
    doc = {
        "model": str(tiny.path),
        "adapter": str(lora),
        "defaults": {"temperature": 0, "max_tokens": 4},
        "cases": [
            {"name": "tuned", "kind": "plain", "prompt": "abc abc abc"},
            {"name": "base", "kind": "plain", "prompt": "abc abc abc", "adapter": None},
        ],
    }
    suite, golden = tmp_path / "suite.yaml", tmp_path / "golden.json"
    suite.write_text(yaml.safe_dump(doc))
    code, _, err = run_cli(
        "regress", "record", str(suite), "-o", str(golden), "--variants", "cold,warm"
    )
    assert code == 0, err
    cases = json.loads(golden.read_text())["cases"]
    digest = check_adapter(lora).digest
    assert cases["tuned"]["adapter"] == {"name": lora.name, "digest": digest}
    assert cases["base"]["adapter"] is None
    tuned = cases["tuned"]["outputs"][0]["tokens"]
    assert (
        tuned
        == mlx_lm_reply(
            tiny.path, lora, _encoded(tiny, "abc abc abc"), SamplingParams(max_tokens=4)
        )[: len(tuned)]
    )
    assert tuned != cases["base"]["outputs"][0]["tokens"]

    other = write_adapter(tiny.path, tmp_path / "other", seed=8)
    suite.write_text(yaml.safe_dump({**doc, "adapter": str(other)}))
    code, out, err = run_cli("regress", "check", str(suite), str(golden), "--variants", "cold")
    assert code == 1
    lines = out.splitlines()
    assert lines[:2] == ["adapter-changed        tuned", "ok                     base"]
    assert re.fullmatch(r"2 cases under 1 variant: 1 passed, 1 failed \(\d+\.\d+ s\)", lines[2])
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warnings[0] == (
        f"warning: case 'tuned' was recorded with adapter {lora.name} ({digest[:12]}) and now "
        f"runs with adapter other ({check_adapter(other).digest[:12]}): "
        "its outputs are another model's, not compared"
    )


def _encoded(loaded: LoadedModel, text: str) -> list[int]:
    from mlxcache.encoder import Encoder

    return Encoder.of(loaded).encode_chat([{"role": "user", "content": text}])


TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}|{{ greeting }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)


def test_a_chat_template_and_its_args_replace_the_models(tiny: LoadedModel, tmp_path: Path) -> None:
    from mlxcache.encoder import Encoder

    file = tmp_path / "t.jinja"
    file.write_text(TEMPLATE)
    messages = [{"role": "user", "content": "ab"}]
    for given in (TEMPLATE, str(file)):
        loaded = load(str(tiny.path), chat_template=given, chat_template_args='{"greeting": "a"}')
        ids = Encoder.of(loaded).encode_chat(messages)
        assert ids == tiny.tokenizer.encode("[user|a]ab>", add_special_tokens=False)
        # a call's own arguments win, as a request's chat_template_kwargs do in mlx-lm
        own = loaded.tokenizer.apply_chat_template(messages, tokenize=False, greeting="b")
        assert own == "[user|b]ab"
    keys = {
        tiny.key,
        load(str(tiny.path), chat_template=TEMPLATE).key,
        load(str(tiny.path), chat_template=TEMPLATE, chat_template_args={"greeting": "a"}).key,
        load(str(tiny.path), chat_template=TEMPLATE, chat_template_args={"greeting": "b"}).key,
    }
    assert len(keys) == 4
    same = load(str(tiny.path), chat_template=str(file), chat_template_args='{"greeting":"a"}')
    assert (
        same.key
        == load(str(tiny.path), chat_template=TEMPLATE, chat_template_args={"greeting": "a"}).key
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["--chat-template", "nope.jinja"],
            "chat template: no such file, and not a Jinja template",
        ),
        (["--chat-template-args", "{bad"], "--chat-template-args is not JSON"),
        (["--chat-template-args", "[1]"], "--chat-template-args must be a JSON object"),
    ],
)
def test_a_bad_chat_template_is_one_line_and_exit_2(
    args: list[str], said: str, tiny: LoadedModel
) -> None:
    code, out, err = run_cli("generate", "-m", str(tiny.path), *args, "-n", "2", "hi")
    assert (code, out) == (2, "")
    assert said in err and len(err.strip().splitlines()) == 1


def test_models_info_shows_the_adapter_and_template(tiny: LoadedModel, lora: Path) -> None:
    code, out, err = run_cli(
        "models",
        "info",
        "-m",
        str(tiny.path),
        "--adapter-path",
        str(lora),
        "--chat-template",
        TEMPLATE,
        "--chat-template-args",
        '{"greeting": "a"}',
        "--json",
    )
    assert code == 0, err
    info = json.loads(out)
    loaded = load(
        str(tiny.path), adapter=lora, chat_template=TEMPLATE, chat_template_args={"greeting": "a"}
    )
    assert loaded.adapter is not None
    assert info["adapter"] == {
        "path": str(lora.resolve()),
        "type": "lora",
        "digest": loaded.adapter.digest,
    }
    assert (info["key"], info["chat_template"], info["chat_template_args"]) == (
        loaded.key,
        "given",
        {"greeting": "a"},
    )


def test_a_server_with_an_adapter_shows_it_and_replies_as_mlx_lm(
    tiny: LoadedModel, lora: Path, tmp_path: Path
) -> None:
    import io

    from asgi import call

    from mlxcache.remote import Wanted, differences
    from mlxcache.server.app import Settings, create_app
    from mlxcache.server.log import RequestLog
    from mlxcache.wire import identity, tailoring
    from mlxcache.worker import EngineWorker

    adapted = load(str(tiny.path), adapter=lora)
    assert adapted.adapter is not None
    config = CacheConfig(block_size=4, directory=tmp_path)
    with EngineWorker(Engine(adapted, make_cache(adapted, config), warm_ahead=False)) as worker:
        card = identity(str(tiny.path), worker.engine, config, True)
        app = create_app(
            worker.engine,
            worker,
            Settings(adapted.name, identity=card),
            RequestLog(stream=io.StringIO()),
        )
        found = call(app, "GET", "/v1/models").json()["data"][0]["mlxcache"]
        assert found["adapter"] == {
            "name": lora.name,
            "type": "lora",
            "digest": adapted.adapter.digest,
        }
        assert found["key"] == adapted.key and found["tailoring"] == tailoring(adapted) != ""
        text = call(
            app,
            "POST",
            "/v1/chat/completions",
            {
                "model": adapted.name,
                "messages": [{"role": "user", "content": "abc abc"}],
                "max_tokens": 6,
                "temperature": 0,
                "mlxcache_usage": True,
            },
        ).json()
    tokens = text["usage"]["mlxcache"]["tokens"]
    prompt = _encoded(tiny, "abc abc")
    assert (
        tokens == mlx_lm_reply(tiny.path, lora, prompt, SamplingParams(max_tokens=6))[: len(tokens)]
    )
    # A command without the adapter is told the server runs another (`--server`).
    plain = Wanted(str(tiny.path), 4, True)
    assert differences(found, plain) == [
        f"adapter and chat template (--adapter, --chat-template): {found['tailoring']} (server) vs none (this command)"
    ]
    from mlxcache.model.loader import tailoring_of

    assert (
        differences(
            found, Wanted(str(tiny.path), 4, True, tailoring=tailoring_of(lora, None, None))
        )
        == []
    )


@pytest.mark.parametrize("spelling", ["--adapter", "--adapter-path"])
def test_generate_with_an_adapter_replies_as_mlx_lm(
    spelling: str, tiny: LoadedModel, lora: Path, tmp_path: Path
) -> None:
    """Both spellings; greedy and seeded; the second run resumes from the disk tier."""
    args = ["-m", str(tiny.path), spelling, str(lora), "--cache-dir", str(tmp_path), "--json"]
    prompt = _encoded(tiny, "abc abc abc abc")
    for params, flags in (
        (GREEDY, []),
        (SEEDED, ["--temp", "0.9", "--top-p", "0.95", "--seed", "11"]),
    ):
        want = mlx_lm_reply(tiny.path, lora, prompt, params)
        for _ in range(2):
            code, out, err = run_cli("generate", *args, "-n", "8", *flags, "abc abc abc abc")
            assert code == 0, err
            tokens = json.loads(out)["tokens"]
            assert tokens and tokens == want[: len(tokens)]
    assert json.loads(out)["stats"]["cached_tokens"] > 0


@pytest.mark.parametrize(
    "command", [["generate"], ["chat"], ["json"], ["tools"], ["serve"], ["models", "info"]]
)
def test_every_model_running_command_takes_an_adapter_and_a_template(command: list[str]) -> None:
    code, out, _ = run_cli(*command, "--help")
    assert code == 0
    for option in ("--adapter", "--adapter-path", "--chat-template", "--chat-template-args"):
        assert re.search(re.escape(option) + r"(?![-\w])", out), f"{command} has no {option}"


def test_a_template_too_long_for_a_path_is_template_text() -> None:
    """A one-line template longer than a file name may be is Jinja text, not an OS error."""
    from mlxcache.model.template import template_text

    text = "{{ messages[0]['content'] }}" + "x" * 300
    assert template_text(text) == text
