"""The trainer on 2 CPU processes (gloo) started by ``accelerate launch``, and the shipped
accelerate configs. The worker (tests/_distributed_worker.py) records what each rank saw."""

from pathlib import Path

import pytest
import torch
import yaml
from _launch import launch_two

pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "accelerate"
WORKER = Path(__file__).with_name("_distributed_worker.py")
WORLD = 2
PER_DEVICE, G = 6, 3

COMMON = [
    "task=ones",
    "device=cpu",
    f"per_device_train_batch_size={PER_DEVICE}",
    f"num_generations={G}",
    "train_size=40",
    "eval_size=5",  # uneven over 2 ranks: 3 + 2 rows
    "eval_batch_size=4",
    "eval_every=0",
    "tensorboard=false",
    "generation.steps=4",
    "generation.gen_length=16",
    "generation.block_length=8",
    "dps.stride=1",
    "learning_rate=1e-3",
    "weight_decay=0.0",
]
RUNS = [
    # wd1 + DPS, the default recipe's method.
    ["method=wd1", "max_steps=3"],
    # Several forwards per backward (SML views, μ old log-probs, reference), gradient
    # accumulation over 2 micro-batches, and a warm-up schedule.
    [
        "method=diffu_grpo",
        "num_iterations=2",
        "beta=0.04",
        "sml.enabled=true",
        "gradient_accumulation_steps=2",
        "warmup_steps=8",
        "max_steps=2",
    ],
]


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, tmp_path_factory):
    """Launch both runs in one ``accelerate launch``; returns [run][rank] records."""
    out = tmp_path_factory.mktemp("ddp")
    args = []
    for i, run in enumerate(RUNS):
        args += (["::"] if i else []) + [f"model={tiny_model_dir}", f"output_dir={out}"]
        args += COMMON + run
    code, log = launch_two(WORKER, [str(out), *args], timeout=600)
    assert code == 0, log[-4000:]
    return [
        [torch.load(out / f"run{i}_rank{r}.pt", weights_only=False) for r in range(WORLD)]
        for i in range(len(RUNS))
    ]


@pytest.mark.parametrize("run", range(len(RUNS)), ids=["wd1-dps", "diffu_grpo-sml-gas2"])
def test_parameters_identical_on_both_ranks(ranks, run):
    r0, r1 = ranks[run]
    assert (r0["rank"], r1["rank"], r0["world"]) == (0, 1, WORLD)
    for k in r0["after"]:
        assert torch.equal(r0["before"][k], r1["before"][k]), k
        assert torch.equal(r0["after"][k], r1["after"][k]), k
    assert any(not torch.equal(r0["before"][k], r0["after"][k]) for k in r0["after"])


@pytest.mark.parametrize("run", range(len(RUNS)), ids=["wd1-dps", "diffu_grpo-sml-gas2"])
def test_ranks_draw_different_prompts(ranks, run):
    r0, r1 = ranks[run]
    assert len(r0["prompts"]) == len(r1["prompts"]) > 0
    for mine, theirs in zip(r0["prompts"], r1["prompts"], strict=True):
        assert len(mine) == len(theirs) == PER_DEVICE // G
        assert not set(mine) & set(theirs)  # disjoint shares of the global batch


@pytest.mark.parametrize("run", range(len(RUNS)), ids=["wd1-dps", "diffu_grpo-sml-gas2"])
def test_dps_statistics_use_the_global_batch(ranks, run):
    """One normalisation per optimizer step, over all its micro-batches on every process
    (METHOD.md §2 [decision])."""
    r0, r1 = ranks[run]
    calls = len(r0["normalized_input"])
    gas = len(r0["prompts"]) // calls  # micro-batches per step
    assert calls * gas == len(r0["prompts"]) > 0 and gas == (2 if run else 1)
    for i in range(calls):
        every0, every1 = r0["normalized_input"][i], r1["normalized_input"][i]
        local0 = torch.cat(r0["local_deltas"][i * gas : (i + 1) * gas])
        local1 = torch.cat(r1["local_deltas"][i * gas : (i + 1) * gas])
        assert local0.shape[0] == gas * PER_DEVICE
        assert every0.shape == (WORLD * gas * PER_DEVICE, local0.shape[1])
        assert torch.equal(every0, every1)
        assert torch.equal(every0, torch.cat([local0, local1]))
        assert not torch.equal(local0, local1)


@pytest.mark.parametrize("run", range(len(RUNS)), ids=["wd1-dps", "diffu_grpo-sml-gas2"])
def test_metrics_and_held_out_agree_across_ranks(ranks, run):
    r0, r1 = ranks[run]
    assert r0["history"] == r1["history"]  # every logged number is the global batch's
    assert r0["summary"] == r1["summary"]
    steps = len(r0["history"])
    assert [h["step"] for h in r0["history"]] == list(range(1, steps + 1))


def test_scheduler_steps_once_per_optimizer_step(ranks):
    """Warm-up lr = lr0 · (k + 1) / 8 after k optimizer steps (μ = 2 per train step), whatever
    the world size (accelerate's default would step the scheduler once per process)."""
    lrs = [h["lr"] for h in ranks[1][0]["history"]]
    assert lrs == pytest.approx([1e-3 * (2 * t + 1) / 8 for t in (1, 2)])


def test_held_out_is_the_mean_over_all_rows(ranks, tiny_model_dir):
    """Before training, the 2-rank held-out metric (3 + 2 rows, one rank padded) equals a
    single-process evaluation of the same 5 rows."""
    from _tasks import sudoku_rows_task

    from daca.models.loading import load
    from daca.train.config import load_config
    from daca.train.evaluation import evaluate

    task = sudoku_rows_task("ones")
    cfg = load_config(None, [f"model={tiny_model_dir}", *COMMON])
    rows = task.load(split="test", path=None, limit=cfg.eval_size, seed=cfg.seed)
    bundle = load(cfg.model, device="cpu")
    res = evaluate(bundle, task, rows, cfg.generation, batch_size=cfg.eval_batch_size)
    assert len(res.scores) == 5
    assert ranks[0][0]["summary"]["held_out_before"] == pytest.approx(res.mean, abs=1e-9)


@pytest.mark.parametrize("name", ["ddp", "deepspeed_zero2", "fsdp", "cpu_2proc"])
def test_accelerate_configs_load(name):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    path = CONFIGS / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    cfg = load_config_from_file(str(path))  # accelerate's own reader rejects unknown keys
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    assert not args.cpu and args.num_processes >= 2  # one process per rank
    if name == "cpu_2proc":
        assert args.multi_gpu and cfg.mixed_precision == "no" and cfg.num_processes == 2
    else:
        assert cfg.mixed_precision == "bf16"
    if name == "ddp":
        assert args.multi_gpu
    if name == "deepspeed_zero2":
        assert args.use_deepspeed and cfg.deepspeed_config["zero_stage"] == 2
        # The daca config's values must win: none of these may be fixed here.
        for key in ("gradient_accumulation_steps", "gradient_clipping"):
            assert key not in raw["deepspeed_config"]
    if name == "fsdp":
        assert args.use_fsdp and cfg.fsdp_config["fsdp_version"] == 2
        assert cfg.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"
