"""Stand-in tasks for trainer tests: Sudoku rows with a reward a random model can move."""

from daca.tasks import Task, get_task


def ones(prompts, completions, **kw):
    """The share of '1' characters in a 16-token completion."""
    return [c.count("1") / 16 for c in completions]


def sudoku_rows_task(name, reward=ones, prompt=None, score=None) -> Task:
    """Sudoku rows with another reward (and prompt); ``score`` defaults to the reward."""
    sudoku = get_task("sudoku")
    score = score or reward
    return Task(
        name=name,
        load=sudoku.load,
        chat_prompt=sudoku.chat_prompt,
        compact_prompt=prompt or sudoku.compact_prompt,
        reward_funcs=[reward],
        score=lambda completions, **kw: score(None, completions),
        columns=sudoku.columns,
    )
