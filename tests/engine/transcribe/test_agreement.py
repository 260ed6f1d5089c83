"""LocalAgreement: partial text is what consecutive passes agree on, and it is never retracted."""

from __future__ import annotations

import numpy as np
import pytest

from engine.model.audio import SAMPLE_RATE, load_audio_file
from engine.transcribe.agreement import LocalAgreement, word_probabilities
from engine.transcribe.offline import Transcriber
from engine.types import DecodeOptions, FallbackOptions, TokenLogprob
from tests.support.speech import english_clips


def _run(passes: list[str], final: str) -> tuple[list[str], str]:
    agreement = LocalAgreement(passes=2)
    deltas = [agreement.update(text) for text in passes]
    deltas.append(agreement.finish_window(final))
    return [delta for delta in deltas if delta], agreement.text


def test_words_two_passes_agree_on_are_sent_once_and_a_word_at_either_end_waits():
    agreement = LocalAgreement(passes=2)
    assert agreement.update("And so my") == "", "one pass alone confirms nothing"
    assert agreement.update("And so my fellow") == " ".join(["And", "so"]), "'my' ends a pass: held back"
    assert agreement.update("And so my fellow Americans,") == " my"
    assert agreement.update("And so my fellow Americans, ask") == " fellow"
    assert agreement.update("And so my fellow Americans, ask not") == " Americans,"
    assert agreement.text == "And so my fellow Americans,"


def test_a_pass_that_hears_committed_words_differently_confirms_nothing_and_retracts_nothing():
    agreement = LocalAgreement(passes=2)
    agreement.update("The long journey home")
    assert agreement.update("The long journey home took") == "The long journey"
    assert agreement.update("The wrong journey home took a") == ""
    assert agreement.update("The long journey home took a year.") == ""  # previous pass disagreed
    assert agreement.update("The long journey home took a year. She") == " home took a"
    assert agreement.text == "The long journey home took a"


def test_the_final_pass_sends_the_rest_and_the_deltas_join_to_the_completed_text():
    deltas, text = _run(
        ["A gold", "A gold ring will", "A gold ring will please most"],
        "A gold ring will please most any girl.",
    )
    assert text == "A gold ring will please most any girl."
    assert "".join(deltas) == text


def test_a_final_pass_that_disagrees_keeps_what_was_sent_and_aligns_the_rest_after_it():
    deltas, text = _run(
        ["She saw a cat in", "She saw a cat in the neighbor"],
        "She saw the cat in the neighbor's house.",
    )
    assert deltas[0] == "She saw a cat", "sent before the final pass"
    assert text == "She saw a cat in the neighbor's house.", "sent words stay; the rest follows them"
    assert "".join(deltas) == text


def test_a_final_pass_that_heard_the_sent_words_differently_loses_none_of_its_later_words():
    # "on" was sent for what the final pass heard as "sauté."; "on" comes again near the end, and
    # aligning on it would drop "sauté. The mechanic ... tires".
    deltas, text = _run(
        ["The market sold fresh fish, she and vegetables on Saturday."] * 2,
        "The market sold fresh fish, cheap and vegetable sauté. The mechanic checked the tires on my car.",
    )
    assert deltas[0] == "The market sold fresh fish, she and vegetables on"
    assert text == (
        "The market sold fresh fish, she and vegetables on sauté. The mechanic checked the tires on my car."
    )
    assert "".join(deltas) == text


def test_a_word_sent_as_two_is_followed_by_the_final_passes_next_word_not_one_past_it():
    deltas, text = _run(["And so am I fellow"] * 2, "And so my fellow Americans, ask not")
    assert deltas[0] == "And so am I"
    assert text == "And so am I fellow Americans, ask not", "'fellow' is kept: a word repeated, none lost"


def test_a_turn_carried_into_a_second_window_extends_the_first_windows_text():
    agreement = LocalAgreement(passes=2)
    first = agreement.finish_window("When you hear the bell,")
    agreement.update("come")
    second = agreement.update("come quickly. Then")
    third = agreement.finish_window("come quickly.")
    assert (first, second, third) == ("When you hear the bell,", "", " come quickly.")
    assert agreement.text == "When you hear the bell, come quickly."


def test_a_final_pass_with_no_words_adds_nothing():
    assert _run([], "") == ([], "")
    assert _run(["Hello there", "Hello there friend"], "") == (["Hello"], "Hello")


def test_three_passes_must_agree_before_a_word_is_sent():
    agreement = LocalAgreement(passes=3)
    assert agreement.update("Very very run.") == ""
    assert agreement.update("Very very fast") == "", "two passes agree, the third has not spoken"
    assert agreement.update("The river runs fast after the spring") == ""
    assert agreement.update("The river runs fast after the spring rains") == ""
    assert (
        agreement.update("The river runs fast after the spring rains in the hills.")
        == "The river runs fast after the"
    )


# tiny.en's partial passes over the start of the jfk turn, every 0.4 s of audio (seconds heard, text):
# from 2.6 to 3.9 s, audio cut after "my fellow Americans" is heard as "am I fellow Americans".
JFK_START = [
    (1.6, "And so much!"),
    (2.0, "And so my fellow"),
    (2.4, "And so my fellow Mary"),
    (2.8, "And so am I fellow Americans."),
    (3.2, "And so am I fellow Americans."),
    (3.6, "And so am I fellow Americans."),
    (4.0, "And so my fellow Americans."),
    (4.4, "And so my fellow Americans asked"),
    (4.8, "And so my fellow Americans ask not"),
    (5.2, "And so my fellow Americans asked not"),
    (5.6, "And so my fellow Americans asked not"),
    (6.0, "And so my fellow Americans asked not why"),
]


def test_passes_must_agree_over_span_s_of_audio_so_a_brief_mishearing_is_not_sent():
    by_count = LocalAgreement(passes=3)
    by_audio = LocalAgreement(passes=3, span_s=2.0)
    for heard_s, text in JFK_START:
        by_count.update(text, heard_s)
        by_audio.update(text, heard_s)
    assert by_count.text.startswith("And so am I"), "three passes 0.4 s apart agree on the mishearing"
    assert by_audio.text == "And so my fellow", "passes over 2 s of audio do not, and agree on what lasts"


def test_with_passes_further_apart_than_span_s_three_passes_still_must_agree():
    agreement = LocalAgreement(passes=3, span_s=1.0)
    assert agreement.update("A gold ring", 2.0) == ""
    assert agreement.update("A gold ring will please", 4.0) == "", "two passes, however far apart"
    assert agreement.update("A gold ring will please most", 6.0) == "A gold", "'ring' ends a pass: held back"


def test_two_passes_sure_of_their_words_commit_them_before_three_passes_over_span_s_agree():
    agreement = LocalAgreement(passes=3, span_s=2.0, sure_passes=2, sure_prob=0.8)
    assert agreement.update("A gold ring will", 1.0, [0.9, 0.95, 0.9, 0.85]) == "", (
        "one pass confirms nothing"
    )
    assert agreement.update("A gold ring will please", 1.5, [0.92, 0.9, 0.97, 0.9, 0.5]) == "A gold ring", (
        "two passes 0.5 s apart, both sure of every word they agree on: committed, but 'will', which "
        "ends one of them, waits for a word after it"
    )
    assert agreement.update("A gold ring will please most", 2.0, [0.9, 0.9, 0.9, 0.9, 0.6, 0.9]) == " will", (
        "'please' is less than 0.8 sure in two passes"
    )


def test_a_word_either_sure_pass_is_unsure_of_stops_the_sure_commit_and_waits_for_the_span():
    agreement = LocalAgreement(passes=3, span_s=2.0, sure_passes=2, sure_prob=0.8)
    agreement.update("And so am I fellow", 1.0, [0.9, 0.9, 0.6, 0.95, 0.9])
    assert (
        agreement.update("And so am I fellow Americans", 1.5, [0.9, 0.9, 0.9, 0.95, 0.9, 0.5]) == "And so"
    ), "'am' is unsure in the first pass: nothing from it on is committed by the sure rule"
    assert agreement.update("And so my fellow Americans ask", 2.0, [0.9] * 6) == ""
    assert agreement.update("And so my fellow Americans ask not", 2.5, [0.9] * 7) == " my fellow Americans", (
        "'ask' ends the pass before"
    )


def test_passes_without_word_probabilities_are_sure_of_nothing():
    agreement = LocalAgreement(passes=3, span_s=2.0, sure_passes=2, sure_prob=0.5)
    assert agreement.update("A gold ring", 1.0) == ""
    assert agreement.update("A gold ring will", 1.5) == ""
    assert agreement.update("A gold ring will please", 2.0, [0.9, 0.9]) == "", "probabilities of other words"
    assert agreement.update("A gold ring will please most", 3.0, [1.0] * 6) == "A gold", (
        "three passes over 2 s commit as before: what they agree on, less the word ending the first"
    )


def test_the_last_word_of_sure_passes_waits_unless_every_pass_is_release_prob_sure_of_it():
    held = LocalAgreement(passes=3, sure_passes=2, sure_prob=0.5)
    released = LocalAgreement(passes=3, sure_passes=2, sure_prob=0.5, release_prob=0.9)
    for agreement in (held, released):
        agreement.update("The river", 1.0, [0.9, 0.95])
    assert held.update("The river", 1.5, [0.9, 0.95]) == "The"
    assert released.update("The river", 1.5, [0.9, 0.95]) == "The river"
    unsure = LocalAgreement(passes=3, sure_passes=2, sure_prob=0.5, release_prob=0.9)
    unsure.update("The river", 1.0, [0.9, 0.95])
    assert unsure.update("The river", 1.5, [0.9, 0.85]) == "The", "one pass is less than 0.9 sure of 'river'"


def test_word_probabilities_multiply_each_words_tokens_and_refuse_tokens_that_are_not_the_text():
    tokens = [
        TokenLogprob(" And", -0.1),
        TokenLogprob(" so", -0.2),
        TokenLogprob(" Amer", -0.3),
        TokenLogprob("icans", -0.4),
    ]
    probs = word_probabilities(tokens, " And so Americans")
    assert probs is not None and len(probs) == 3
    assert [round(p, 6) for p in probs] == [
        round(np.exp(-0.1), 6),
        round(np.exp(-0.2), 6),
        round(np.exp(-0.7), 6),
    ]
    assert word_probabilities(tokens, "And so Americans,") is None
    assert word_probabilities([], "") == []


@pytest.mark.slow
def test_on_live_speech_the_words_sent_early_are_the_final_passes_words(tiny_en):
    """Partial passes of tiny.en every 0.5 s over a turn as the server sees it (0.3 s of padding
    before the speech, 0.5 s of silence after): the deltas join to the final pass's text."""
    transcriber = Transcriber(loaded=tiny_en)
    clips = {clip.id: clip for clip in english_clips()}
    for clip_id in ["tts_01"]:  # tiny.en hears "Very very" in its first second
        speech = load_audio_file(clips[clip_id].path)
        turn = np.concatenate([np.zeros(SAMPLE_RATE * 3 // 10), speech, np.zeros(SAMPLE_RATE // 2)]).astype(
            np.float32
        )
        agreement, deltas = LocalAgreement(), []
        for end_s in np.arange(0.5, len(turn) / SAMPLE_RATE, 0.5):
            audio = turn[: int(end_s * SAMPLE_RATE)]
            partial = transcriber.transcribe([audio], DecodeOptions(max_tokens=int(10 + 6 * end_s)))[0]
            deltas.append(agreement.update(partial.text))
        final = transcriber.transcribe([turn], DecodeOptions(fallback=FallbackOptions()))[0].text
        deltas.append(agreement.finish_window(final))
        assert any(deltas[:-1]), f"{clip_id}: some text is sent before the final pass"
        assert "".join(deltas) == agreement.text == final.strip(), clip_id
