"""``bench.vllm_engine.divergence``: when two greedy decodings of one prompt count as the
same (the vLLM tests' reference check for a prefix loaded from kvstore)."""

from __future__ import annotations

from bench.vllm_engine import divergence


def decoding(tokens: list[int], logprobs: list[dict[int, float]]) -> dict:
    # as they come back from the engine process: JSON, so the token ids are strings
    return {"tokens": tokens, "logprobs": [{str(t): lp for t, lp in position.items()} for position in logprobs]}


REFERENCE = decoding([5, 7, 9], [{5: -1.0, 6: -2.0}, {7: -3.00, 8: -3.02, 4: -5.0}, {9: -0.5}])


def test_the_same_tokens_with_close_logprobs_are_the_same_decoding():
    assert divergence(decoding([5, 7, 9], [{5: -1.01, 6: -2.0}, {7: -3.01, 8: -3.02}, {9: -0.52}]), REFERENCE) is None


def test_parting_at_a_near_tie_is_the_same_decoding_and_nothing_after_it_is_compared():
    parted = decoding([5, 8, 1], [{5: -1.0, 6: -2.0}, {8: -3.00, 7: -3.01}, {1: -0.1}])
    assert divergence(parted, REFERENCE) is None


def test_parting_on_a_token_the_reference_did_not_rank_near_its_top_is_another_decoding():
    parted = decoding([5, 3, 9], [{5: -1.0, 6: -2.0}, {3: -2.99, 7: -3.0}, {9: -0.5}])
    assert "no near tie in the reference's" in divergence(parted, REFERENCE)


def test_parting_where_the_result_did_not_rank_the_references_token_near_its_top_is_another_decoding():
    parted = decoding([5, 8, 9], [{5: -1.0, 6: -2.0}, {8: -3.01, 3: -3.05}, {9: -0.5}])
    assert "no near tie in the result's" in divergence(parted, REFERENCE)


def test_logprobs_apart_at_the_parting_are_another_decoding():
    parted = decoding([5, 8, 9], [{5: -1.0, 6: -2.0}, {8: -2.80, 7: -3.0}, {9: -0.5}])
    assert "at token 1 the logprobs differ" in divergence(parted, REFERENCE)


def test_the_same_tokens_with_logprobs_apart_before_the_parting_are_another_decoding():
    shifted = decoding([5, 7, 9], [{5: -1.0, 6: -2.5}, {7: -3.0, 8: -3.02}, {9: -0.5}])
    assert "logprobs differ" in divergence(shifted, REFERENCE)
    late = decoding([5, 7, 9], [{5: -1.0}, {7: -3.0}, {9: -0.9}])
    assert "at token 2" in divergence(late, REFERENCE)


def test_decodings_of_other_lengths_differ():
    assert divergence(decoding([5, 7], REFERENCE["logprobs"][:2]), REFERENCE) == "2 tokens against 3"


def test_logprobs_apart_pass_where_only_the_decisions_are_compared():
    shifted = decoding([5, 8, 9], [{5: -1.3, 6: -2.5}, {8: -2.9, 7: -3.0}, {9: -0.1}])
    assert divergence(shifted, REFERENCE, logprobs_within=None) is None
    assert "no near tie in the reference's" in divergence(decoding([5, 4, 9], shifted["logprobs"]), REFERENCE, logprobs_within=None)
