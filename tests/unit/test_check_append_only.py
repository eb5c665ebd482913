"""The offline checker against numbers computed by hand on a word-level tokenizer.

Each word is one token. Turn 1 renders `system : a b c d e f g h . user : q1 x . assistant :`
(18 tokens). Turn 2 of "faithful" continues it with `r1 r2 r3 .` (the generated ids), so with
block size 2 all 18 prompt tokens and all 22 prompt + reply tokens are reusable. In "reasoning"
the template strips `<think> t1 </think>` from history: the prompt still shares 18 tokens, but
the server's generated ids diverge at once: 18 of 23 (78 %), flagged.
"""

import json

import pytest

from app.ops.check_append_only import main

WORDS = ["[UNK]", "system", ":", ".", "user", "assistant", *"abcdefgh", "q1", "x", "r1", "r2", "r3", "q2", "y",
         "<think>", "t1", "</think>"]
TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m.role == 'assistant' and loop.index0 < ns.last_user %}"
    "{{ m.role }} : {{ m.content.split('</think>')[-1].strip() }} . {% else %}{{ m.role }} : {{ m.content }} . "
    "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")


@pytest.fixture
def word_model(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", chat_template=TEMPLATE).save_pretrained(
        tmp_path)
    return tmp_path


def test_checker_matches_hand_computed_numbers(word_model, capsys):
    from pathlib import Path

    transcripts = Path(__file__).parents[1] / "data" / "transcripts.jsonl"
    assert len(transcripts.read_text().splitlines()) == 2 and json.loads(transcripts.read_text().splitlines()[0])
    assert main([str(transcripts), "--model", str(word_model), "--block-size", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "faithful turn 2: 29 tokens, shared 18, full blocks reusable 18 (100% of last prompt); "
        "with generated ids: shared 22, reusable 22 (100% of last prompt + reply)",
        "reasoning turn 2: 27 tokens, shared 18, full blocks reusable 18 (100% of last prompt); "
        "with generated ids: shared 18, reusable 18 (78% of last prompt + reply)  << under threshold",
        "1 of 2 later turns under 90%",
    ]
