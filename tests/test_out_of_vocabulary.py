"""Sampled ids outside the tokenizer (Dream: 152064 embedding rows, 151667 tokens) decode to a
visible placeholder that every task scores 0, instead of crashing or being silently dropped."""

import torch

from daca.models.loading import LoadedModel
from daca.models.prompts import OUT_OF_VOCABULARY, decode_completions
from daca.models.tiny import build_tokenizer
from daca.tasks import get_task

DREAM_EMBEDDING_ROWS, DREAM_TOKENIZER = 152064, 151667


def small_bundle() -> LoadedModel:
    """A small tokenizer standing for Dream's: its embedding has more rows than tokens."""
    tok = build_tokenizer()
    return LoadedModel(
        model=None,
        tokenizer=tok,
        mask_id=tok.mask_token_id,
        family="dream",
        eos_ids=(tok.eos_token_id,),
        pad_id=tok.pad_token_id,
    )


def test_ids_beyond_the_tokenizer_decode_to_the_placeholder():
    bundle = small_bundle()
    tok = bundle.tokenizer
    vocabulary = len(tok)
    one, two = tok.convert_tokens_to_ids(["1", "2"])
    # The same gap as Dream's: ids from len(tokenizer) up to the embedding's last row.
    beyond = [vocabulary, vocabulary + DREAM_EMBEDDING_ROWS - DREAM_TOKENIZER - 1]
    eos = tok.eos_token_id
    ids = torch.tensor(
        [
            [one, two, one, eos],
            [one, beyond[0], two, eos],
            [beyond[1], one, two, eos],
            [one, two, eos, beyond[1]],  # after end-of-sequence: cut off, never decoded
        ]
    )
    texts = decode_completions(bundle, ids)
    assert texts == ["121", OUT_OF_VOCABULARY, OUT_OF_VOCABULARY, "12"]
    # Without the check the fast tokenizer drops the id and "12" would be scored as an answer.
    assert tok.decode([one, beyond[0], two]) == "12"


def test_the_placeholder_scores_zero_on_every_task_that_parses_text():
    sudoku, countdown, gsm8k = get_task("sudoku"), get_task("countdown"), get_task("gsm8k")
    for task in (sudoku, countdown):
        row = task.load("test", limit=1, seed=0)[0]
        assert task.score([OUT_OF_VOCABULARY], **{k: [row[k]] for k in task.columns}) == [0.0]
        rewards = [
            f([""], [OUT_OF_VOCABULARY], **{k: [row[k]] for k in task.columns})
            for f in task.reward_funcs
        ]
        assert all(r == [0.0] for r in rewards)
    gsm_row = {"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}
    assert gsm8k.score([OUT_OF_VOCABULARY], **{k: [v] for k, v in gsm_row.items()}) == [0.0]
    json_schema = get_task("json_schema")
    schema = {"type": "object"}  # any JSON object would pass: the placeholder holds none
    assert json_schema.score([OUT_OF_VOCABULARY], schema=[schema]) == [0.0]
