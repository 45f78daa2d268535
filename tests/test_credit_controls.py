"""Two controls on DPS's credit (METHOD.md §2): the oracle (ground-truth labels of trace steps and
answer cells, its multipliers against a hand computation, a real training step) and the
per-sequence centring (by hand, and the sequence-ratio invariant it exists for)."""

import json
import math

import pytest
import torch

from daca.cli import main
from daca.core import objectives
from daca.core.dps import center_per_sequence, oracle_multipliers
from daca.tasks import countdown_trace, get_task, sudoku_trace
from daca.tasks.credit_labels import completion_of, token_labels

SOLUTION = "1234341221434321"
PUZZLE = "1034340220430321"  # cells 1, 6, 9, 12 blank: 2, 1, 1, 4
SPECIAL = {"[PAD]", "[EOS]"}


def _tokens(text: str) -> list[str]:
    from daca.models.tiny import build_tokenizer

    tok = build_tokenizer(get_task("sudoku-trace").compact_vocabulary)
    return tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])


def test_answer_cells_are_the_blanks_graded_against_the_solution():
    answer = SOLUTION[:6] + "3" + SOLUTION[7:]  # cell 6 (a blank) wrong
    text = f"<reasoning>\nr1c2=2n\n</reasoning>\n<answer>\n{answer}\n</answer>"
    cells = sudoku_trace.answer_cell_spans(text, PUZZLE, SOLUTION)
    at = text.index("<answer>\n") + len("<answer>\n")
    assert cells == [(at + 1, at + 2, True), (at + 6, at + 7, False), (at + 9, at + 10, True),
                     (at + 12, at + 13, True)]  # fmt: skip
    # Not 16 digits: the reward is 0, and every digit written is wrong.
    short = text.replace(answer, answer[:15])
    assert [right for *_, right in sudoku_trace.answer_cell_spans(short, PUZZLE, SOLUTION)] == [
        False
    ] * 15
    assert sudoku_trace.answer_cell_spans("<answer>\n1234", PUZZLE, SOLUTION) == []  # no tags


def test_countdown_answer_is_one_unit_right_when_it_earns_the_full_reward():
    text = "<reasoning>\n3+5=8 8*2=16\n</reasoning>\n<answer>\n(3+5)*2\n</answer>"
    start = text.index("(3+5)")
    assert countdown_trace.answer_spans(text, [3, 5, 2], 16) == [(start, start + 7, True)]
    assert countdown_trace.answer_spans(text, [3, 5, 2], 17) == [(start, start + 7, False)]
    assert countdown_trace.answer_spans("<answer>\n \n</answer>", [3], 3) == []


def test_token_labels_follow_the_units_they_lie_in():
    # r1c2=2 right (cell 1 is 2), r2c3=4 wrong (cell 6 is 1); the answer's blank 9 is wrong.
    answer = SOLUTION[:9] + "2" + SOLUTION[10:]
    text = f"<reasoning>\nr1c2=2n r2c3=4n\n</reasoning>\n<answer>\n{answer}\n</answer>"
    tokens = [*_tokens(text), "[EOS]", "[PAD]"]
    row = {"puzzle": PUZZLE, "solution": SOLUTION}
    task = get_task("sudoku-trace")
    completion = completion_of(tokens, SPECIAL)
    assert completion == text
    spans = task.trace_steps(completion, row) + task.answer_cells(completion, row)
    labels = dict(enumerate(token_labels(tokens, SPECIAL, spans)))
    assert [labels[i] for i in range(2, 10)] == [1, 1, 1, 0, -1, -1, -1, 0]  # steps, separators
    first_digit = tokens.index("<answer>") + 2
    answer_labels = [labels[first_digit + i] for i in range(16)]
    assert answer_labels == [0, 1, 0, 0, 0, 0, 1, 0, 0, -1, 0, 0, 1, 0, 0, 0]  # blanks only
    assert labels[len(tokens) - 1] == 0 and labels[len(tokens) - 2] == 0  # special tokens


def test_oracle_multipliers_by_hand():
    labels = torch.tensor([[1, -1, 0], [1, 1, -1], [1, -1, 1]])
    advantages = torch.tensor([2.0, -1.0, 0.0])  # the third completion: A = 0, scores 0
    reference = torch.tensor([[1.0, 1.0, 1.0], [1.0, 2.0, 0.0], [1.0, 1.0, 1.0]])
    valid = torch.ones(3, 3, dtype=torch.bool)
    got, stats = oracle_multipliers(labels, advantages, reference, valid)
    # Scores o = label * sign(A): [1, -1, 0], [-1, -1, 1], [0, 0, 0]; mean -1/9, E[o^2] 5/9.
    mean_o, std_o = -1 / 9, math.sqrt(5 / 9 - 1 / 81)
    mu, sigma = 1.0, math.sqrt(2 / 9)  # the reference: eight values, 1 / 2 / 0 once each
    scores = [[1, -1, 0], [-1, -1, 1], [0, 0, 0]]
    want = torch.tensor([[mu + sigma * (o - mean_o) / std_o for o in r] for r in scores])
    assert torch.allclose(got, want, atol=1e-6)
    assert got.mean().item() == pytest.approx(mu, abs=1e-6)  # DPS's mean and spread kept
    assert got.std(correction=0).item() == pytest.approx(sigma, abs=1e-6)
    # corr(reference, o): E[ref * o] = (1 - 1 + 0 - 1 - 2 + 0) / 9 = -3/9.
    want_corr = (-3 / 9 - mu * mean_o) / (sigma * std_o)
    assert stats["dps/oracle_corr"] == pytest.approx(want_corr, abs=1e-9)


def test_oracle_multipliers_leave_out_what_is_not_valid_and_gather_every_process():
    labels = torch.tensor([[1, -1, 1, 1]])
    advantages = torch.tensor([1.0])
    reference = torch.tensor([[0.5, 1.5, 9.0, 1.0]])
    valid = torch.tensor([[True, True, False, True]])
    got, _ = oracle_multipliers(labels, advantages, reference, valid)
    # Over the valid three: ref mean 1, spread sqrt(1/6); o = [1, -1, 1], mean 1/3.
    sigma, std_o = math.sqrt(1 / 6), math.sqrt(1 - 1 / 9)
    up, down = 1 + sigma * (2 / 3) / std_o, 1 + sigma * (-4 / 3) / std_o
    assert torch.allclose(got, torch.tensor([[up, down, 1.0, up]]), atol=1e-6)  # invalid: mu
    # Two processes with the same rows: the same statistics, so the same multipliers.
    twice, _ = oracle_multipliers(
        labels, advantages, reference, valid, gather=lambda t: torch.cat([t, t])
    )
    assert torch.equal(twice, got)
    # No label anywhere: every score equal, every multiplier DPS's mean.
    flat, stats = oracle_multipliers(torch.zeros_like(labels), advantages, reference, valid)
    assert torch.allclose(flat, torch.ones_like(flat)) and stats["dps/oracle_corr"] == 0.0
    with pytest.raises(ValueError, match="share their"):
        oracle_multipliers(labels[:, :3], advantages, reference, valid)


def test_the_oracle_gets_dps_s_clamp_and_centring_in_dps_s_order():
    """dps.clamp_min and dps.center shape the oracle's multipliers as they shape DPS's (clamp,
    then centre), worked out by hand; without them the oracle's own can fall below 0."""
    from daca.train.rollout import RolloutBatch, oracle_credit

    def batch(labels, advantages, reference, mask):
        n = len(labels)
        return RolloutBatch(
            prompt_ids=torch.zeros(n, 1, dtype=torch.long),
            prompt_mask=torch.ones(n, 1, dtype=torch.long),
            completion_ids=torch.zeros(n, 4, dtype=torch.long),
            completion_mask=torch.tensor(mask),
            rewards=torch.zeros(n),
            advantages=torch.tensor(advantages),
            multipliers=torch.tensor(reference),
            labels=torch.tensor(labels),
        )

    # Two micro-batches of one step; reference mean 1, spread 2 over the 6 valid tokens.
    batches = [
        batch([[1, -1, 0, 0]], [1.0], [[3.0, -1.0, 3.0, 0.0]], [[1, 1, 1, 0]]),
        batch([[1, 1, -1, 0]], [-1.0], [[-1.0, 3.0, -1.0, 0.0]], [[1, 1, 1, 0]]),
    ]
    # o = label * sign(A) = [1, -1, 0 | -1, -1, 1]: mean -1/6, E o² 5/6, std sqrt(29)/6.
    mean_o, std_o = -1 / 6, math.sqrt(29) / 6
    raw = [[1 + 2 * (o - mean_o) / std_o for o in row] for row in ([1, -1, 0], [-1, -1, 1])]
    plain, stats = oracle_credit(batches)
    assert stats["dps/oracle_min"] == pytest.approx(min(min(row) for row in raw), abs=1e-6)
    assert stats["dps/oracle_max"] == pytest.approx(max(max(row) for row in raw), abs=1e-6)
    assert torch.allclose(plain[0][0, :3], torch.tensor(raw[0]), atol=1e-6)
    assert plain[1][0, :3].min() < 0  # the flip clamp_min exists for

    clamped = [[max(v, 0.0) for v in row] for row in raw]
    got, _ = oracle_credit(batches, clamp_min=0.0)
    for g, want in zip(got, clamped, strict=True):
        assert torch.allclose(g[0, :3], torch.tensor(want), atol=1e-6)
    assert got[0][0, 3] == pytest.approx(1.0)  # not valid: the reference mean, unclamped

    centred = [[v - sum(row) / 3 + 1 for v in row] for row in clamped]
    got, _ = oracle_credit(batches, clamp_min=0.0, center="sequence")
    for g, want in zip(got, centred, strict=True):
        assert torch.allclose(g[0, :3], torch.tensor(want), atol=1e-6)
        assert g[0, :3].mean().item() == pytest.approx(1.0)


def test_oracle_credit_trains_with_the_recorded_dps_mean_and_spread(tmp_path):
    """Two steps of Diffu-GRPO with the oracle on the shipped trace model: the recorded
    multipliers are the hand formula of the recorded DPS multipliers, labels and advantages."""
    from daca.models import load
    from daca.models.prompts import up_to_eos
    from daca.train.rollout import completion_labels

    code = main([
        "train", "model=tiny", "task=sudoku-trace", "method=diffu_grpo", f"output_dir={tmp_path}",
        "name=run", "device=cpu", "per_device_train_batch_size=6", "num_generations=6",
        "num_iterations=1", "max_steps=2", "eval_size=2", "eval_every=0", "tensorboard=false",
        "save_rollouts_every=1", "generation.cache=dual", "generation.temperature=0.9",
        "dps.enabled=true", "dps.stride=4", "dps.credit=oracle",
    ])  # fmt: skip
    assert code == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(-1 <= r["dps/oracle_corr"] <= 1 for r in rows)
    record = json.loads((run / "rollouts" / "step-0000002.json").read_text())
    assert record["credit"] == "oracle"
    bundle = load("tiny-sudoku-trace")
    tok = bundle.tokenizer
    ids = torch.tensor([tok.convert_tokens_to_ids(t) for t in record["tokens"]])
    columns = record["columns"]
    task_rows = [dict(zip(columns, v, strict=True)) for v in zip(*columns.values(), strict=True)]
    labels = completion_labels(bundle, get_task("sudoku-trace"), ids, task_rows)
    assert (labels != 0).any()  # the shipped model writes steps and answers
    want, _ = oracle_multipliers(
        labels,
        torch.tensor(record["advantages"]),
        torch.tensor(record["dps_multipliers"]),
        up_to_eos(ids, bundle.eos_ids),
    )
    assert torch.allclose(torch.tensor(record["multipliers"]), want, atol=1e-5)


def test_the_oracle_is_refused_where_it_cannot_run(tmp_path, capsys):
    # (The TRL front-end refuses it too: tests/test_trl_integration.py.)
    from daca.train.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match="needs dps.enabled"):
        validate(load_config(None, ["dps.enabled=false", "dps.credit=oracle"]))
    code = main([
        "train", "task=sudoku", f"output_dir={tmp_path}", "name=r", "dps.credit=oracle",
        "max_steps=1", "tensorboard=false",
    ])  # fmt: skip
    assert code != 0
    assert "grades its trace steps and answer cells" in capsys.readouterr().err


def test_center_per_sequence_by_hand():
    m = torch.tensor([[1.5, 0.5, -1.0, 9.0], [2.0, 2.0, 2.0, 2.0]])
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).bool()
    got = center_per_sequence(m, valid)
    # Row 0: valid mean 1/3, shifted by +2/3; row 1: mean 2, shifted by -1; invalid untouched.
    want = torch.tensor([[1.5 + 2 / 3, 0.5 + 2 / 3, -1 / 3, 9.0], [1.0, 1.0, 2.0, 2.0]])
    assert torch.allclose(got, want)


def test_centred_multipliers_leave_a_sequence_ratio_as_its_base():
    """GDPO's sequence reduction scales one ratio per completion by the mean of A·m_n over its
    tokens: centred multipliers have mean 1, so at the first inner step (rho = 1) the loss and
    its gradient are the base method's, while the raw multipliers change them."""
    g = torch.Generator().manual_seed(0)
    terms = (-torch.rand(4, 6, generator=g, dtype=torch.float64)).requires_grad_()
    advantages = torch.tensor([0.5, -0.5, 1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    raw = 1 + 0.5 * torch.randn(4, 6, generator=g, dtype=torch.float64)

    def loss_and_grad(multipliers):
        loss, _ = objectives.gdpo_loss(
            terms, terms.detach(), advantages, mask, token_multipliers=multipliers,
            reduction="sequence",
        )  # fmt: skip
        (grad,) = torch.autograd.grad(loss, terms)
        return loss, grad

    base_loss, base_grad = loss_and_grad(None)
    loss, grad = loss_and_grad(center_per_sequence(raw, mask))
    assert torch.allclose(loss, base_loss) and torch.allclose(grad, base_grad)
    raw_loss, raw_grad = loss_and_grad(raw)
    assert not torch.allclose(raw_grad, base_grad)


def test_a_centred_run_records_multipliers_of_mean_one(tmp_path):
    from daca.models import load
    from daca.models.prompts import up_to_eos

    code = main([
        "train", "model=tiny", "task=sudoku-trace", "method=gdpo", f"output_dir={tmp_path}",
        "name=run", "device=cpu", "per_device_train_batch_size=6", "num_generations=6",
        "num_iterations=1", "max_steps=1", "eval_size=2", "eval_every=0", "tensorboard=false",
        "save_rollouts_every=1", "generation.cache=dual", "dps.enabled=true", "dps.stride=4",
        "dps.center=sequence",
    ])  # fmt: skip
    assert code == 0
    record = json.loads((tmp_path / "run" / "rollouts" / "step-0000001.json").read_text())
    bundle = load("tiny-sudoku-trace")
    ids = torch.tensor([bundle.tokenizer.convert_tokens_to_ids(t) for t in record["tokens"]])
    mask = up_to_eos(ids, bundle.eos_ids)
    m = torch.tensor(record["multipliers"])
    means = (m * mask).sum(1) / mask.sum(1)
    assert torch.allclose(means, torch.ones_like(means), atol=1e-5)
    assert m[mask].std() > 0.01  # still DPS's multipliers within each completion
