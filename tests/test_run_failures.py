"""A run that must stop does so cleanly: one rank of two failing under FSDP (a reward function
raising, an out-of-memory error) ends both within a bounded time with one message and no
traceback from a rank; a checkpoint write failing with any exception (here a model whose
``save_pretrained`` raises AttributeError) leaves no partial folder and names the cause and
the previous checkpoint. (A full disk: tests/test_reliability.py.)"""

import re
import time
from pathlib import Path

import pytest
from _launch import fsdp_cpu_config, launch_two
from _tasks import sudoku_rows_task
from conftest import SMALL_RUN

from daca.cli import main
from daca.tasks import register_task
from daca.train import checkpointing as checkpoint
from daca.train.trainer import Trainer

register_task("ones", lambda: sudoku_rows_task("ones"))
WORKER = Path(__file__).with_name("_kill_worker.py")
SMALL = [
    *SMALL_RUN,
    "eval_every=0",
]


@pytest.mark.parametrize(
    ("task", "env", "message"),
    [
        (
            "ones_rank1_fails",
            {},
            r"error: reward function ones failed on example 0 .*injected failure on rank 1",
        ),
        (
            "ones",
            {"DACA_OOM_STEP": "1"},
            r"error: out of memory in step 2 on process 1 \(CUDA out of memory\. Tried to "
            r"allocate 2\.00 GiB\)\. No checkpoint was written; lower "
            r"per_device_train_batch_size.*daca train --resume",
        ),
    ],
    ids=["reward-error", "out-of-memory"],
)
def test_one_failing_rank_stops_both_with_one_message(tiny_model_dir, tmp_path, task, env, message):
    pytest.importorskip("accelerate")
    args = [f"model={tiny_model_dir}", f"output_dir={tmp_path}", "name=r", f"task={task}"]
    t0 = time.monotonic()
    code, log = launch_two(
        WORKER,
        ["train", "--no-progress", *args, *SMALL, "max_steps=4"],
        timeout=600,  # a rank left waiting would wait out gloo's 30 min
        env=env,
        config=fsdp_cpu_config(tmp_path),
    )
    took = time.monotonic() - t0
    assert code != 0
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), log[-4000:]
    assert "[rank" not in log  # no rank printed a traceback (the launcher's summary aside)
    print(f"{task} {env}: both ranks ended {took:.1f} s after the launch")


def test_a_checkpoint_write_failing_with_any_error_leaves_no_partial_folder(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    load_model = Trainer._load_model

    def model_whose_save_fails_at_step_2(self):
        bundle = load_model(self)
        save = bundle.model.save_pretrained

        def save_pretrained(folder, **kw):
            if self.step == 2:
                raise AttributeError("'NoneType' object has no attribute 'to_dict'")
            return save(folder, **kw)

        bundle.model.save_pretrained = save_pretrained
        return bundle

    monkeypatch.setattr(Trainer, "_load_model", model_whose_save_fails_at_step_2)
    args = [f"model={tiny_model_dir}", f"output_dir={tmp_path}", "name=a", "task=ones"]
    args += [*SMALL, "max_steps=3", "save_every=1"]
    code = main(["train", "--no-progress", *args])
    err = capsys.readouterr().err
    run_dir = tmp_path / "a"
    assert code == 1 and "Traceback" not in err
    assert re.search(
        rf"could not write the checkpoint of step 2 to {run_dir}/checkpoints \(AttributeError: "
        rf"'NoneType' object has no attribute 'to_dict'\); the partial folder was removed and "
        rf"the previous checkpoint {run_dir}/checkpoints/step-0000001 is intact\. Fix the cause, "
        rf"then continue with `daca train --resume {run_dir}`",
        err,
    ), err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-0000001"]
    monkeypatch.setattr(Trainer, "_load_model", load_model)  # fixed
    assert main(["train", "--resume", str(run_dir), "--no-progress"]) == 0
    assert f"resuming {run_dir} from step 1" in capsys.readouterr().out
    assert [s for s, _ in checkpoint.list_checkpoints(run_dir)][-1] == 3
