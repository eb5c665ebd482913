"""The embedded default model: a tiny random-weight Qwen3 built locally, byte for byte the same everywhere.

corpus.txt -> BPE tokenizer; seeded random weights; a Qwen3-like chat template -> a model folder
that vLLM and transformers load like any hub model. Its text is gibberish; its token ids are what
the tests compare, and they depend on context (initializer_range 0.2, untied embeddings).
"""

import fcntl
import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
"""Added but not special, as in Qwen3: they survive detokenisation, so replies carry their reasoning
and tool calls for the parsers to find."""
BUILD_VERSION = "4"  # bump when anything below changes, so old builds are not reused
TARGET_VOCAB_SIZE = 2048
MAX_MODEL_LEN = 8192

# Qwen3's two reuse-breaking habits, reproduced on purpose (seed 000):
# - non-thinking mode appends an empty think block to the generation prompt, but history
#   renders the answer without it;
# - reasoning of assistant turns before the last user message is dropped from history.
# Tools as Qwen3 renders them: their schemas in the system turn, calls as <tool_call> JSON inside
# the assistant turn, consecutive tool results in one user turn as <tool_response>s.
CHAT_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if tools and loop.first and m.role == 'system' %}"
    "{% elif m.role == 'assistant' %}"
    "{% set content = m.content or '' %}"
    "{% set reasoning = m.reasoning_content or '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_user and reasoning %}"
    "<think>\n{{ reasoning }}\n</think>\n\n"
    "{% endif %}"
    "{{ content }}"
    "{% for call in m.tool_calls or [] %}"
    "{% if loop.first and content or not loop.first %}{{ '\\n' }}{% endif %}"
    "{% set call = call.function or call %}"
    "<tool_call>\n{\"name\": \"{{ call.name }}\", \"arguments\": "
    "{% if call.arguments is string %}{{ call.arguments }}{% else %}{{ call.arguments | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


def corpus_lines() -> list[str]:
    """The text the tokenizer is trained on; benchmarks build prompts from it too."""
    return (Path(__file__).parent / "corpus.txt").read_text().splitlines()


def blank_token_bias(tokenizer) -> dict[str, float]:
    """logit_bias against whitespace-only tokens: the random weights fill JSON with the whitespace
    a grammar allows until max_tokens (where the grammar requires a blank, as in fixed markup, it
    is still the only choice), so constrained tool calls get this to end."""
    blank = [i for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip() and tokenizer.decode([i])]
    return {str(i): -100.0 for i in blank}


def ensure_tiny_model(folder: Path) -> Path:
    """Build the model into `folder` unless a complete build is there; safe across processes."""
    folder.mkdir(parents=True, exist_ok=True)
    done = folder / "BUILD_COMPLETE"
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists() or done.read_text() != BUILD_VERSION:
            _build(folder)
            done.write_text(BUILD_VERSION)
    return folder


def _build(folder: Path) -> None:
    tokenizer = _build_tokenizer()
    tokenizer.save_pretrained(folder)
    _build_weights(vocab_size=len(tokenizer), eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                   folder=folder)


def _build_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TARGET_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus_lines(), trainer=trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:], chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_MODEL_LEN)


def _build_weights(vocab_size: int, eos_token_id: int, folder: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=MAX_MODEL_LEN,
        initializer_range=0.2, tie_word_embeddings=False, eos_token_id=eos_token_id,
        bos_token_id=eos_token_id, pad_token_id=0, dtype="float32")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(eos_token_id=eos_token_id, do_sample=False).save_pretrained(folder)
    (folder / "build.json").write_text(json.dumps({"version": BUILD_VERSION, "vocab_size": vocab_size}))
