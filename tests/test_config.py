"""Config loading, overrides and validation: every bad input names its key."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daca.cli import main
from daca.train.config import ConfigError, TrainConfig, describe, load_config, resolved

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_defaults_are_the_documented_main_job():
    cfg = load_config()
    assert (cfg.model, cfg.task, cfg.method, cfg.dps.enabled) == ("tiny", "sudoku", "wd1", True)
    assert cfg == resolved(TrainConfig()) and cfg.beta == 0.0


def test_overrides_reach_nested_fields_and_convert_types():
    cfg = load_config(
        None, ["dps.lam=0.25", "max_steps=7", "learning_rate=3e-6", "lora.target_modules=[a, b]"]
    )
    assert cfg.dps.lam == 0.25 and cfg.max_steps == 7 and cfg.learning_rate == 3e-6
    assert cfg.lora.target_modules == ["a", "b"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dps.lamb=1"], "unknown key 'dps.lamb'; did you mean 'dps.lam'"),
        (["max_step=3"], "did you mean 'max_steps'"),
        (["max_steps=abc"], "max_steps: expected an integer"),
        (["method=wd2"], "did you mean 'wd1'"),
        (["dps.enabled=yes please"], "dps.enabled: expected true/false"),
        (["num_generations=1"], "num_generations=1"),
        (["per_device_train_batch_size=10"], "not a multiple of num_generations=6"),
        (["generation.gen_length=20"], "not a multiple of generation.block_length=16"),
        (
            ["generation.gen_length=32", "generation.steps=7"],
            "not divisible by the number of blocks 2",
        ),
        (["beta=-1"], "beta must be >= 0"),
        ([".nan"], "expected key=value"),
        (["dps.lam=.nan"], "dps.lam: expected a finite number"),
        (["psi=.inf"], "psi: expected a finite number"),
        (["variant=full"], "variant: 'full' is not one of"),
        (["sml.num_strata=0"], "sml.num_strata must be >= 1"),
        (["dps=3"], "dps: expected a mapping"),
        (["novalue"], "expected key=value"),
        (["load_in_4bit=true"], "load_in_4bit needs lora.enabled"),
        (["generation.refresh_every=0"], "generation.refresh_every must be >= 1"),
        (["generation.trace_refresh=prefix"], "generation.trace_refresh: 'prefix' is not one of"),
    ],
)
def test_bad_configs_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_method_defaults_and_variant_switch():
    assert load_config(None, ["method=diffu_grpo"]).beta == 0.04
    assert load_config(None, ["method=gdpo"]).beta == 0.0
    assert load_config(None, ["method=diffu_grpo", "beta=0"]).beta == 0.0
    for variant, (d, s) in {
        "base": (False, False),
        "sml": (False, True),
        "daca": (True, True),
    }.items():
        cfg = load_config(None, [f"variant={variant}"])
        assert (cfg.dps.enabled, cfg.sml.enabled) == (d, s)


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("dps: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_keys = st.sampled_from(
    [line.split(" = ")[0] for line in describe()] + ["bogus", "dps.bogus", "generation"]
)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=4))
def test_generated_configs_fail_only_with_config_errors(pairs):
    """Whatever is thrown at it, the loader answers with a valid config or a ConfigError."""
    overrides = [f"{k}={v!r}" if not isinstance(v, str) else f"{k}={v}" for k, v in pairs.items()]
    try:
        load_config(None, overrides)
    except ConfigError as e:
        assert str(e)


def test_every_shipped_tiny_recipe_validates():
    recipes = sorted((CONFIGS / "tiny").glob("*.yaml"))
    assert recipes, "configs/tiny holds the tiny recipes"
    for path in recipes:
        load_config(path)


def test_cli_version_help_and_dry_run(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert "daca 0.1.0" in capsys.readouterr().out
    assert main([]) == 0
    assert "train" in capsys.readouterr().out
    assert main(["train", "--dry-run", "dps.lam=0.2", "per_device_train_batch_size=12"]) == 0
    out = capsys.readouterr().out
    assert "2 prompts x 6 = 12 completions per step" in out
    assert main(["train", "--dry-run", "dps.lamb=0.2"]) == 2
    assert "did you mean 'dps.lam'" in capsys.readouterr().err


def test_a_model_folder_brings_the_lengths_it_was_trained_for(tmp_path, monkeypatch):
    import json

    from daca.train import config

    (tmp_path / "daca.json").write_text(
        json.dumps({"generation": {"gen_length": 64, "steps": 32, "block_length": 32,
                                   "temperature": 0.0}})
    )  # fmt: skip
    monkeypatch.setattr(config, "SHIPPED", {"tiny": tmp_path})
    g = load_config(None, []).generation
    assert (g.gen_length, g.steps, g.block_length) == (64, 32, 32)
    assert g.temperature == config.GenerationConfig().temperature  # lengths only
    g = load_config(None, ["generation.steps=16"]).generation  # the command line wins
    assert (g.gen_length, g.steps, g.block_length) == (64, 16, 32)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("generation: {gen_length: 32, block_length: 32}\n")
    g = load_config(recipe, []).generation  # and so does the recipe
    assert (g.gen_length, g.steps, g.block_length) == (32, 32, 32)
    trained = tmp_path / "checkpoint"  # a run's saved model folder brings its lengths too
    trained.mkdir()
    (trained / "daca.json").write_text(json.dumps({"generation": {"gen_length": 32}}))
    assert load_config(None, [f"model={trained}"]).generation.gen_length == 32
    (trained / "daca.json").write_text("{not json")  # reported when the model loads
    g = load_config(None, [f"model={trained}"]).generation
    assert g.gen_length == config.GenerationConfig().gen_length
    g = load_config(None, [f"model={recipe}"]).generation  # no daca.json beside it
    assert g.gen_length == config.GenerationConfig().gen_length
