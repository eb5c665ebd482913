"""The embedded model's template must break reuse exactly as Qwen3's does (seed 000)."""

import pytest

from app.model.tiny import ensure_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_tiny_model(tmp_path_factory.mktemp("tiny")))


def _render(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


TURN1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_non_thinking_mode_drops_the_empty_think_block_from_history(tokenizer):
    first = _render(tokenizer, TURN1, enable_thinking=False)
    assert first.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    second = _render(tokenizer, TURN1 + [{"role": "assistant", "content": "Hello"},
                                         {"role": "user", "content": "More"}], enable_thinking=False)
    assert "<|im_start|>assistant\nHello<|im_end|>" in second
    assert not second.startswith(first), "history must not replay the generation prompt's think block"


def test_thinking_mode_strips_earlier_reasoning(tokenizer):
    reply = {"role": "assistant", "content": "<think>\nplan\n</think>\n\nHello"}
    second = _render(tokenizer, TURN1 + [reply, {"role": "user", "content": "More"}])
    assert "plan" not in second and "Hello" in second
    ongoing = tokenizer.apply_chat_template(TURN1 + [reply], tokenize=False)
    assert "<think>\nplan\n</think>\n\nHello" in ongoing, "reasoning after the last user turn is kept"


def test_build_is_deterministic(tmp_path):
    a, b = ensure_tiny_model(tmp_path / "a"), ensure_tiny_model(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_append_keeps_the_recorded_tokens_and_adds_only_the_new_messages(tokenizer, tmp_path):
    from app.conversations.records import ConversationRecord
    from app.conversations.rendering import PromptRenderer

    renderer = PromptRenderer(tokenizer.name_or_path, 4096)
    first = renderer.chat(TURN1, {"enable_thinking": False})
    generated = tokenizer.encode("Hello there", add_special_tokens=False)
    record = ConversationRecord(token_ids=(*first, *generated), num_prompt_tokens=len(first), message_keys=("k",),
                                created_at=0.0)
    messages = TURN1 + [{"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "More"}]
    appended = renderer.append(record, messages, 2, {"enable_thinking": False})
    assert appended[:len(record.token_ids)] == list(record.token_ids)
    tail = tokenizer.decode(appended[len(record.token_ids):])
    assert tail == "<|im_end|>\n<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
