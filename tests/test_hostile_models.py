"""Hostile model folders: `daca eval --model DIR` and `daca train model=DIR` refuse them with one
line and exit 2, run none of their code, and a chat template cannot hang them."""

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from _hub import LLADA_CHAT_TEMPLATE, imported_python, poison, write_llada
from conftest import SMALL_RUN, one_error_line
from safetensors.torch import load_file

from daca.cli import main
from daca.models import prompts
from daca.models.loading import load
from daca.models.prompts import ChatTemplateError, render_chat

TINY = Path(__file__).resolve().parents[1] / "src" / "daca" / "assets" / "tiny"
MESSAGE = [{"role": "user", "content": "What is 2 + 3?"}]


def _eval(folder, capsys) -> tuple[int, str]:
    code = main(
        [
            "eval",
            "--task",
            "sudoku",
            "--model",
            str(folder),
            "--limit",
            "2",
            "--device",
            "cpu",
            "--out",
            str(Path(folder).parent / "eval.jsonl"),
        ]
    )
    return code, capsys.readouterr().err


def _train(folder, tmp_path, capsys) -> tuple[int, str]:
    args = [
        f"model={folder}",
        f"output_dir={tmp_path / 'runs'}",
        "name=hostile",
        *SMALL_RUN,
        "max_steps=1",
        "eval_every=0",
    ]
    code = main(["train", "--no-progress", *args])
    return code, capsys.readouterr().err


def _tiny_copy(tmp_path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(TINY, folder)
    return folder


class _Payload:
    """Unpickling it touches a marker file: proof that a loader unpickled the checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def _pickle_only(tmp_path) -> tuple[Path, Path]:
    folder = _tiny_copy(tmp_path)
    weights = load_file(folder / "model.safetensors")
    marker = tmp_path / "unpickled"
    torch.save(
        {**weights, "payload": _Payload(marker)},
        folder / "pytorch_model.bin",
        pickle_protocol=pickle.DEFAULT_PROTOCOL,
    )
    (folder / "model.safetensors").unlink()
    return folder, marker


# ---------------------------------------------------------------- weights as a pickle
def test_a_pickle_only_checkpoint_is_refused_and_not_unpickled(tmp_path, capsys):
    folder, marker = _pickle_only(tmp_path)
    code, err = _eval(folder, capsys)
    line = one_error_line(err)
    assert code == 2 and "pytorch_model.bin" in line and "safetensors" in line
    assert not marker.exists()
    code, err = _train(folder, tmp_path, capsys)
    assert code == 2 and "pickle" in one_error_line(err) and not marker.exists()


# ---------------------------------------------------------------- daca.json
@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("{not json", "is not JSON"),
        ('["compact"]', "JSON object"),
        ('{"family": "llada", "prompt_width": "wide"}', "prompt_width must be int"),
        ('{"family": "llada", "prompt_width": true}', "prompt_width must be int"),
        ('{"family": "llada", "generation": {"gen_length": -4}}', "gen_length must be positive"),
        ('{"family": "llada", "prompt_format": "poem"}', "prompt_format must be one of"),
        ('{"family": "llada", "prompt_fromat": "chat"}', "unknown key(s) ['prompt_fromat']"),
    ],
    ids=["not-json", "not-object", "wrong-type", "bool", "negative", "bad-format", "unknown"],
)
def test_a_bad_daca_json_is_one_line(tmp_path, capsys, text, named):
    folder = _tiny_copy(tmp_path)
    (folder / "daca.json").write_text(text)
    code, err = _eval(folder, capsys)
    line = one_error_line(err)
    assert code == 2 and "daca.json" in line and named in line, line


def test_a_bad_daca_json_stops_training_with_one_line(tmp_path, capsys):
    folder = _tiny_copy(tmp_path)
    (folder / "daca.json").write_text('{"family": "llada", "prompt_width": "wide"}')
    code, err = _train(folder, tmp_path, capsys)
    assert code == 2 and "prompt_width must be int" in one_error_line(err)


def test_the_shipped_models_daca_json_passes_the_check():
    for folder in TINY.parent.glob("tiny*"):
        assert load(str(folder)).meta == json.loads((folder / "daca.json").read_text())


# ---------------------------------------------------------------- code the folder names
def test_an_auto_map_to_unknown_code_is_refused_and_not_imported(tmp_path, capsys):
    folder = _tiny_copy(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="hostile",
        auto_map={
            "AutoConfig": "configuration_hostile.C",
            "AutoModelForMaskedLM": "modeling_hostile.M",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "daca.json").unlink()
    poison(folder, ["configuration_hostile", "modeling_hostile"])
    code, err = _eval(folder, capsys)
    line = one_error_line(err)
    assert code == 2 and "auto_map" in line and "'hostile'" in line
    assert imported_python(folder) == []


@pytest.mark.parametrize(
    "model_type",
    ["qwen3", "llada2_moe", "Dream-v2"],
    ids=["an-autoregressive-model", "an-unsupported-family", "a-misspelt-family"],
)
def test_an_unknown_architecture_is_one_line_naming_the_families(tmp_path, capsys, model_type):
    """Neither a native family nor a masked LM transformers ships: one line naming every
    native family, before a weight is read (the weights here are not even safetensors)."""
    from daca.models.families import FAMILIES

    folder = _tiny_copy(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    (folder / "model.safetensors").write_bytes(b"not weights: reading them would fail otherwise")
    code, err = _eval(folder, capsys)
    line = one_error_line(err)
    assert code == 2 and f"model_type {model_type!r}" in line
    for family in FAMILIES.values():
        assert family.name in line and family.model_types[0] in line


def test_a_mixture_of_experts_under_llada_s_model_type_is_one_line(tmp_path, capsys):
    """LLaDA's model type on a Qwen-MoE-style config.json (``moe_intermediate_size``, not
    LLaDA-MoE's ``num_experts``: tests/test_llada_moe.py runs those): refused in one line, no
    weight read."""
    folder = _tiny_copy(tmp_path)
    moe = {
        "model_type": "llada",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "moe_intermediate_size": 32,
        "num_experts_per_tok": 2,
        "vocab_size": 157184,
    }
    (folder / "config.json").write_text(json.dumps(moe))
    (folder / "model.safetensors").write_bytes(b"not weights: reading them would fail otherwise")
    code, err = _eval(folder, capsys)
    line = one_error_line(err)
    assert code == 2 and "mixture of experts" in line and "moe_intermediate_size=32" in line
    assert "a2d-qwen3" in line and "llada-moe" in line  # the families daca does run


# ---------------------------------------------------------------- chat templates
def _llada_with_template(tmp_path, template: str) -> Path:
    folder = write_llada(tmp_path / "llada", shards=1)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


NESTED_LOOPS = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"


def test_a_chat_template_that_loops_for_hours_stops_eval_with_one_line(
    tmp_path, capsys, monkeypatch
):
    """Before: `daca eval` rendered 99999² loop iterations (hours)."""
    monkeypatch.setattr(prompts, "CHAT_TEMPLATE_SECONDS", 0.5)
    folder = _llada_with_template(tmp_path, NESTED_LOOPS)
    code, err = _eval(folder, capsys)
    line = one_error_line(err)
    assert code == 2 and "chat_template did not render a prompt within 0.5 s" in line
    assert str(folder) in line
    code, err = _train(folder, tmp_path, capsys)
    assert code == 2 and "chat_template did not render" in one_error_line(err)


class _Tokenizer:
    def __init__(self, template):
        self.chat_template = template

    def apply_chat_template(self, messages, **kwargs):
        from transformers.utils.chat_template_utils import render_jinja_template

        return render_jinja_template([messages], chat_template=self.chat_template, **kwargs)[0][0]


@pytest.mark.parametrize(
    ("template", "named"),
    [
        ("{{ 9 ** 9 ** 9 }}", "uses '**'"),
        ("{% for x in messages %}", "is not valid jinja"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "failed on a prompt"),
        ("{{ raise_exception('no system role') }}", "failed on a prompt: TemplateError"),
        ("x" * (prompts.MAX_CHAT_TEMPLATE_CHARS + 1), "characters, more than"),
    ],
    ids=["power", "syntax", "recursion", "raises", "too-long"],
)
def test_a_hostile_chat_template_is_one_error(template, named):
    with pytest.raises(ChatTemplateError) as e:
        render_chat(_Tokenizer(template), MESSAGE, seconds=5)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_a_template_that_renders_too_much_is_an_error():
    template = "{% for a in range(99999) %}{{ 'x' * 99 }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="rendered 9899901 characters"):
        render_chat(_Tokenizer(template), MESSAGE, seconds=30)


def test_real_chat_templates_render_as_transformers_renders_them(tmp_path):
    from transformers import AutoTokenizer

    folder = write_llada(tmp_path / "llada", shards=1)
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template == LLADA_CHAT_TEMPLATE
    expected = tok.apply_chat_template(MESSAGE, add_generation_prompt=True, tokenize=False)
    assert render_chat(tok, MESSAGE) == expected
    assert expected.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
