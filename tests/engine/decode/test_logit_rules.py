"""Whisper's logit rules on a whole batch at once, against transformers' processors applied to each
row alone: the rows differ in history (none yet, text, an open segment, a closed pair, timestamps
earlier on) and in whether they want timestamps at all. The histories reach the rules the way the
engine gives them: token by token, through ``record``, into each row's slot on the device."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    WhisperTimeStampLogitsProcessor,
)

from engine.decode.step.logit_rules import MAX_INITIAL_TIMESTAMP_S, LogitRules
from engine.model.tokenizer import WhisperTokenizer
from tests.support.models import bundled_tokenizer

# tiny.en's vocabulary; its tokenizer alone is read (the GPU machine has no bundled weights).
ENGLISH_VOCAB = 51864


def histories(begin: int, eot: int, rng: random.Random) -> list[list[int]]:
    """Sampled-so-far token lists that end in every state the timestamp rules tell apart."""

    def text() -> int:
        return rng.randrange(0, eot)

    def stamp(low: int = 0) -> int:
        return begin + rng.randrange(low, 1500)

    return [
        [],
        [text()],
        [stamp()],  # a first timestamp: like a closed pair, text must follow
        [stamp(10), text(), text()],  # text after an opening timestamp
        [stamp(), text(), stamp(700)],  # text, then a timestamp: an open segment
        [stamp(), stamp()],  # a closed pair
        [text(), stamp(), text(), stamp(900), stamp(901)],  # a closed pair after text
        [stamp(3), text(), stamp(40), text()],  # text after two timestamps: the floor is the last
        [text(), text(), text()],  # text only: no floor
        [text(), stamp(1499)],  # an open segment at the last timestamp
    ]


def transformers_rules(
    logits: torch.Tensor,
    prompt: list[int],
    sampled: list[int],
    with_timestamps: bool,
    rules: LogitRules,
    special,
) -> torch.Tensor:
    """One row through transformers' processors, as generate() would apply them."""
    ids = torch.tensor([prompt + sampled])
    scores = logits[None].clone()
    scores = SuppressTokensLogitsProcessor(rules.suppress_token_ids)(ids, scores)
    scores = SuppressTokensAtBeginLogitsProcessor(rules.begin_suppress_token_ids, len(prompt))(ids, scores)
    if with_timestamps:
        config = GenerationConfig(
            eos_token_id=special.eot, max_initial_timestamp_index=round(MAX_INITIAL_TIMESTAMP_S / 0.02)
        )
        config.no_timestamps_token_id = special.no_timestamps
        scores = WhisperTimeStampLogitsProcessor(config, begin_index=len(prompt))(ids, scores)
    return scores[0]


def record_histories(rules: LogitRules, outputs: list[list[int]], timestamps: list[bool]) -> None:
    """Row i's history into slot i, one sampled token at a time, as the engine records them; rows
    of different lengths record at different steps, and rows without timestamps record nothing."""
    for position in range(max(len(sampled) for sampled in outputs)):
        rows = [row for row, sampled in enumerate(outputs) if len(sampled) > position]
        tokens = torch.tensor([outputs[row][position] for row in rows], device=rules.device)
        rules.record(
            tokens, rules.timestamp_rows([position == 0] * len(rows), [timestamps[row] for row in rows], rows)
        )


@pytest.mark.slow
@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_batched_rules_match_transformers_row_by_row(use_triton):
    tokenizer = WhisperTokenizer(bundled_tokenizer("tiny.en"), ENGLISH_VOCAB)
    special = tokenizer.special
    begin = special.timestamp_begin
    rng = random.Random(0)
    outputs, timestamps = [], []
    for with_timestamps in (True, False):
        for sampled in histories(begin, special.eot, rng):
            outputs.append(sampled)
            timestamps.append(with_timestamps)
    # The Triton kernels run compiled on a GPU, under Triton's interpreter elsewhere.
    device = torch.device("cuda" if use_triton and torch.cuda.is_available() else "cpu")
    # The tokenizer's non-speech tokens and openai-whisper's begin suppression (no model's own lists).
    rules = LogitRules(
        tokenizer, ENGLISH_VOCAB, None, None, device, num_slots=len(outputs), use_triton=use_triton
    )
    # A slot reused by a new window: what its last owner left there must not count.
    left_over = [begin + 5 if row % 2 else 11 for row in range(len(outputs))]  # a timestamp or text
    rules.record(
        torch.tensor(left_over, device=device),
        rules.timestamp_rows([True] * len(outputs), [True] * len(outputs), list(range(len(outputs)))),
    )
    record_histories(rules, outputs, timestamps)
    vocab = ENGLISH_VOCAB
    prompt = [special.sot, special.no_timestamps]
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(outputs), vocab, generator=generator) * 3
    # Make timestamps together likelier than any text token in some rows and not in others, so the
    # last rule (forbid text when timestamps win) goes both ways.
    logits[::3, begin:] += 6.0
    expected = torch.stack(
        [
            transformers_rules(logits[row], prompt, outputs[row], timestamps[row], rules, special)
            for row in range(len(outputs))
        ]
    )
    wins = 0
    for rows in (list(range(len(outputs))), list(range(0, len(outputs), 2)), [4]):
        # the whole batch, every other row (a gather), one row
        ours = logits[rows].to(device)
        first = [not outputs[row] for row in rows]
        rules.apply(ours, first, rules.timestamp_rows(first, [timestamps[row] for row in rows], rows))
        ours = ours.cpu()
        theirs = expected[rows]
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), rows
        finite = ~torch.isinf(theirs)
        assert torch.equal(ours[finite], theirs[finite])
        assert torch.equal(ours.argmax(dim=-1), theirs.argmax(dim=-1))
        wins += int(torch.isinf(ours[:, :begin]).all(dim=-1).sum())
    assert wins > 0  # some row had text forbidden outright (first token, or the timestamp rule)
    # Each state was told apart. (Timestamps made unlikely here, so that the last rule leaves text be.)
    full = logits.clone().to(device)
    full[:, begin:] -= 20.0
    first = [not sampled for sampled in outputs]
    rules.apply(full, first, rules.timestamp_rows(first, timestamps, list(range(len(outputs)))))
    full = full.cpu()
    first_limit = begin + round(MAX_INITIAL_TIMESTAMP_S / 0.02)
    assert torch.isinf(full[0, :begin]).all()  # the first token is a timestamp, at most 1 s in
    assert (
        not torch.isinf(full[0, begin : first_limit + 1]).any()
        and torch.isinf(full[0, first_limit + 1 :]).all()
    )
    assert torch.isinf(full[4, : special.eot]).all() and not math.isinf(full[4, special.eot])  # open segment
    assert torch.isinf(full[5, begin:]).all() and not torch.isinf(full[5, :begin]).all()  # closed pair
    floor = outputs[7][2]  # text after two timestamps: none below the last one, nor the last one
    assert torch.isinf(full[7, begin : floor + 1]).all() and not torch.isinf(full[7, floor + 1 :]).all()
    without = len(outputs) // 2  # the same histories without timestamps: no timestamp rule applies
    assert not torch.isinf(full[without + 7, begin : floor + 1]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_rules_for_first_tokens_and_timestamps_never_wait_for_the_device():
    """The decode loop applies the rules between launching a step and reading the one before: a
    synchronizing call here would make the host wait for the step it just launched."""
    tokenizer = WhisperTokenizer(bundled_tokenizer("tiny.en"), ENGLISH_VOCAB)
    device = torch.device("cuda")
    rules = LogitRules(tokenizer, ENGLISH_VOCAB, None, None, device, num_slots=8, use_triton=True)
    logits = torch.randn(8, ENGLISH_VOCAB, device=device)
    first = [True, False, True, False, False, False, True, False]
    timestamps = [False] * 6 + [True, True]  # a first row and a later one with the timestamp rules
    stamp_rows = rules.timestamp_rows(first, timestamps, list(range(8)))
    rules.apply(logits.clone(), first, stamp_rows)  # compiles the kernels before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rules.apply(logits, first, rules.timestamp_rows(first, timestamps, list(range(8))))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    suppressed = torch.isinf(logits[:, rules.begin_suppress_token_ids]).cpu()
    assert suppressed[[0, 2, 6]].all() and not suppressed[[1, 3, 4, 5]].any()
