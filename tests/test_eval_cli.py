"""``daca eval`` and ``daca sample`` on a tiny model and the public file formats."""

import json
import os

import torch

from daca.cli import main
from daca.tasks.files import write_countdown_jsonl, write_sudoku_csv
from daca.tasks.sudoku import generate_puzzles


def test_eval_reads_public_sudoku_csv_and_writes_jsonl(tiny_model_dir, tmp_path, capsys):
    rows = generate_puzzles(6, split="test", seed=1)
    data = tmp_path / "sudoku.csv"
    write_sudoku_csv(data, rows)
    out = tmp_path / "out.jsonl"
    code = main(
        [
            "eval",
            "--task",
            "sudoku",
            "--model",
            str(tiny_model_dir),
            "--data-file",
            str(data),
            "--out",
            str(out),
            "--device",
            "cpu",
            "--gen-length",
            "16",
            "--steps",
            "4",
            "--block-length",
            "16",
        ]
    )
    assert code == 0
    lines = [json.loads(x) for x in out.open()]
    assert [x["prompt"] for x in lines] == [r["puzzle"] + "=" for r in rows]
    assert all(0.0 <= x["score"] <= 1.0 for x in lines)
    mean = sum(x["score"] for x in lines) / len(lines)
    assert f"sudoku: {mean:.4f} ±" in capsys.readouterr().out


def test_eval_limit_and_countdown_jsonl(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "cd.jsonl"
    write_countdown_jsonl(
        data, [{"numbers": [3, 5, 7], "target": 22}, {"numbers": [2, 4, 6], "target": 48}]
    )
    out = tmp_path / "o.jsonl"
    assert (
        main(
            [
                "eval",
                "--task",
                "countdown",
                "--model",
                str(tiny_model_dir),
                "--data-file",
                str(data),
                "--limit",
                "1",
                "--out",
                str(out),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert len(out.read_text().splitlines()) == 1
    assert "n=1" in capsys.readouterr().out


def test_sample_prints_answers(tiny_model_dir, capsys):
    assert (
        main(
            [
                "sample",
                "--task",
                "sudoku",
                "--model",
                str(tiny_model_dir),
                "-n",
                "2",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("completion:") == 2 and "mean score" in out


def test_a_training_checkpoint_is_a_model_eval_accepts(tiny_model_dir, tmp_path, capsys):
    """`daca eval --model runs/<run>/checkpoints/step-N/model`: the tiny model's compact
    prompts and the run's generation settings come from the checkpoint's daca.json."""
    from daca.core.modeling import forward_logits
    from daca.models import load
    from daca.train.config import load_config
    from daca.train.trainer import Trainer

    overrides = [f"model={tiny_model_dir}", f"output_dir={tmp_path}", "name=run", "max_steps=1",
                 "eval_every=0", "eval_size=4", "train_size=8", "tensorboard=false",
                 "per_device_train_batch_size=12", "num_generations=6",
                 "generation.steps=4", "generation.block_length=8"]  # fmt: skip
    trainer = Trainer(load_config(None, overrides), progress=False)
    trainer.train()
    checkpoint = tmp_path / "run" / "checkpoints" / "step-0000001" / "model"
    saved = load(str(checkpoint))
    assert saved.prompt_format == "compact" and saved.meta["generation"]["block_length"] == 8
    ids = torch.randint(3, 20, (2, 10))
    model = trainer.acc.unwrap_model(trainer.model).eval()
    assert torch.equal(forward_logits(saved.model, ids), forward_logits(model, ids))
    out = tmp_path / "eval.jsonl"
    code = main(["eval", "--task", "sudoku", "--model", str(checkpoint), "--limit", "3",
                 "--out", str(out)])  # fmt: skip
    assert code == 0 and len(out.read_text().splitlines()) == 3
    assert "L=16, steps=4, block=8" in capsys.readouterr().out
    # `daca export` of that run: every file it writes, the weights too, follows the umask.
    umask = os.umask(0o027)
    try:
        assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "exported")]) == 0
    finally:
        os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "exported").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o640}, modes


def test_eval_of_a_folder_that_is_no_model_is_one_line(tmp_path, capsys):
    assert main(["eval", "--task", "sudoku", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_eval_cache_refreshed_every_step_changes_no_completion(tmp_path, capsys):
    """The shipped LLaDA model through ``daca eval``: ``--cache dual --refresh-every 1`` is the
    uncached sampler to the token; a refresh per rollout (one block) is an approximation."""
    outputs = {}
    for name, flags in {
        "none": [],
        "dual1": ["--cache", "dual", "--refresh-every", "1"],
        "dual": ["--cache", "dual"],
    }.items():
        out = tmp_path / f"{name}.jsonl"
        args = ["eval", "--task", "sudoku", "--model", "tiny", "--limit", "16", "--out", str(out)]
        assert main([*args, "--device", "cpu", *flags]) == 0
        outputs[name] = [json.loads(x)["completion"] for x in out.open()]
    assert "cache=dual, refresh_every=1" in capsys.readouterr().out
    assert outputs["dual1"] == outputs["none"]
    assert outputs["dual"] != outputs["none"]
    assert main(["eval", "--task", "sudoku", "--cache", "dual", "--refresh-every", "0"]) == 2
