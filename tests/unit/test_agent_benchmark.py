"""The agent benchmark's setup of the embedded model's calls."""

from dataclasses import replace

from app.config import TINY_MODEL, AppConfig
from benchmarks.agent import call_bias


class BlankAndWord:
    """A two-token vocabulary: a blank and a word."""

    def __len__(self) -> int:
        return 2

    def decode(self, ids: list[int]) -> str:
        return [" ", "word"][ids[0]]


def test_the_embedded_model_reached_by_url_gets_the_bias_that_ends_its_calls():
    """With --url the model is the tokenizer's path and the served name says which model it is:
    without the bias the random weights fill each call with blanks until max_tokens."""
    by_url = replace(AppConfig(), model="/models/tiny-qwen3", served_model_name=TINY_MODEL)
    assert call_bias(AppConfig(), BlankAndWord()) == call_bias(by_url, BlankAndWord()) == {"logit_bias": {"0": -100.0}}
    assert call_bias(replace(by_url, served_model_name="Qwen/Qwen3-32B"), BlankAndWord()) == {}
