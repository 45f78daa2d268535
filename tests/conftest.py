import sys

import pytest
import torch

from daca.models.tiny import build_model, tiny_config


def random_mlm(vocab_size: int = 32, seed: int = 0, **kw):
    """A small random bidirectional masked LM (ModernBERT) for tests."""
    kw.setdefault("hidden_size", 64)
    kw.setdefault("num_layers", 2)
    kw.setdefault("num_heads", 2)
    kw.setdefault("intermediate_size", 128)
    return build_model(tiny_config(vocab_size, **kw), seed=seed)


@pytest.fixture
def tiny_random_model():
    return random_mlm()


@pytest.fixture(autouse=True)
def _few_threads():
    torch.set_num_threads(1)  # tiny models: a second thread costs more than it gives


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """Each test starts with no accelerate state, as each `daca train` process does: the state
    is process-wide, and a bf16 trainer after an fp32 one would otherwise be refused. This is
    what accelerate's own ``AccelerateTestCase`` does (a private method: accelerate is pinned)."""
    yield
    state = sys.modules.get("accelerate.state")  # none to reset when no test imported it
    if state is not None and state.AcceleratorState._shared_state:
        state.AcceleratorState._reset_state(reset_partial_state=True)


def save_tiny_model(path, seed: int = 0, hidden_size: int = 32, num_layers: int = 1):
    """A random tiny LLaDA in the shipped models' format (LLaDA's hub layout, tokenizer,
    daca.json), saved to path. It reads 36 positions: prompts of up to 20 tokens beside the
    tiny tasks' 16-token completions."""
    from daca.models.tiny import new_tiny, save_tiny

    model, tok = new_tiny(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=2,
        intermediate_size=2 * hidden_size,
        max_positions=36,
        seed=seed,
    )
    return save_tiny(path, model, tok)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


# TrainingArguments of every TRL test: CPU, float32, no checkpointing of activations, no trackers.
CPU_TRL = dict(use_cpu=True, bf16=False, activation_checkpointing=False, report_to="none")

# The smallest real training run (2 completions of 8 tokens per prompt, 4 denoising steps), as
# `daca train` overrides; tests add the task, the steps and what they check.
SMALL_RUN = [
    "device=cpu",
    "per_device_train_batch_size=4",
    "num_generations=2",
    "train_size=20",
    "eval_size=2",
    "save_rollouts_every=0",
    "tensorboard=false",
    "generation.steps=4",
    "generation.gen_length=8",
    "generation.block_length=8",
    "dps.stride=1",
]


def left_pad(rows: list[list[int]], pad_id: int):
    """Token rows left-padded to one width: ids and attention mask [B, width]."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row) :] = torch.tensor(row)
        mask[r, width - len(row) :] = 1
    return ids, mask


def assert_batch_generates_each_prompt_alone(bundle, rows: list[list[int]], **sampler) -> None:
    """Greedy generation on the left-padded batch of ``rows`` gives each row the completion it
    gets alone, unpadded (a loaded ``daca.models.load`` bundle; ``sampler``: other arguments
    of ``generate``)."""
    from daca.core.modeling import attention_anchor_of
    from daca.core.sampler import generate
    from daca.models.prompts import pad_for_model

    ids, mask = pad_for_model(bundle.model, rows, bundle.pad_id)  # left_pad, or LLaDA 2.x's
    kw = dict(mask_id=bundle.mask_id, gen_length=8, steps=8, block_length=4, temperature=0.0)
    kw |= sampler
    with torch.no_grad():
        batch = generate(bundle.model, ids, mask, **kw).completion_ids
        for r, row in enumerate(rows):
            alone = (torch.tensor([row]), None)  # in whole blocks for LLaDA 2.x
            if attention_anchor_of(bundle.model) == "start":
                alone = pad_for_model(bundle.model, [row], bundle.pad_id)
            alone = generate(bundle.model, *alone, **kw).completion_ids
            assert batch[r].tolist() == alone[0].tolist()


def one_error_line(err: str) -> str:
    """The one line starting 'error:' (progress bars may stand beside it); no traceback."""
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return errors[0]


def lora_adapted(bundle, r: int = 4, targets=None):
    """The bundle's model under PEFT LoRA on ``targets`` (None: its family's), every B drawn
    off 0 (B = 0 at init would give the A matrices no gradient)."""
    from peft import LoraConfig, get_peft_model

    from daca.models.families import lora_targets

    torch.manual_seed(0)
    targets = targets or lora_targets(bundle)
    model = get_peft_model(bundle.model, LoraConfig(r=r, target_modules=targets))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(1))
    return model


def lora_sgd_step(model, ids) -> set[str]:
    """One loss.backward() and SGD step on random targets; the adapted projections whose LoRA
    got a gradient."""
    from daca.core.modeling import forward_logits

    model.train()
    targets = torch.randint(0, 250, ids.shape, generator=torch.Generator().manual_seed(9))
    logits = forward_logits(model, ids)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
    hit = {
        n.split(".lora_")[0]
        for n, p in model.named_parameters()
        if p.grad is not None and p.grad.abs().sum() > 0
    }
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    return hit


def assert_the_plan_counts_the_adapters_peft_builds(folder, targets=None, r: int = 4):
    """The memory plan's LoRA count (``ModelShape.lora_parameters``, read off config.json)
    equals the trainable parameters PEFT builds on the loaded checkpoint for ``targets``
    (None: the family's default), adapter by adapter."""
    from daca.models import load
    from daca.models.families import model_shape

    shape, _ = model_shape(str(folder))
    model = lora_adapted(load(str(folder)), r=r, targets=targets)
    trained = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert sum(trained.values()) == shape.lora_parameters(r, targets)
    adapted = {n.split(".lora_")[0].removeprefix("base_model.model.") for n in trained}
    assert len(adapted) == len(shape.adapted(targets))
    return shape


def assert_moe_tokenizer_ids_and_no_remote_code(folder, bundle) -> None:
    """A checkpoint written with ``_hub_moe.write_moe_tokenizer`` (LLaDA-MoE's and LLaDA 2.x's
    tokenizer): mask 156895, ends 156892 and <|role_end|> 156900, pad 156892, read off it; its
    ``*.py`` never imported, with or without ``trust_remote_code``."""
    from _hub import imported_python

    from daca.models import load

    assert (bundle.mask_id, bundle.eos_ids, bundle.pad_id) == (156895, (156892, 156900), 156892)
    for trust in (False, True):
        load(str(folder), trust_remote_code=trust)
    assert imported_python(folder) == []
