"""The oracle: one plain vLLM engine, aggregated, prefix caching on, greedy. A conversation served
through the disaggregated pipeline must produce its token ids (tests, benchmarks.faults)."""

from typing import Any

import ray

from app.config.engines import SCHEDULER_ARGS


@ray.remote(num_cpus=0)
class ReferenceEngine:
    def __init__(self, model_path: str, engine_kwargs: dict[str, Any]) -> None:
        from vllm import LLM

        self.llm = LLM(model=model_path, **engine_kwargs, enable_prefix_caching=True)

    def generate(self, prompts: list[list[int]], max_tokens: int, regex: str | None = None,
                 sampling: dict[str, Any] | None = None) -> list[list[int]]:
        """Greedy; `sampling`: more SamplingParams arguments (vLLM's names), ignore_eos among them."""
        return [ids for ids, _ in self.replies(prompts, max_tokens, regex, sampling)]

    def replies(self, prompts: list[list[int]], max_tokens: int, regex: str | None = None,
                sampling: dict[str, Any] | None = None) -> list[tuple[list[int], str]]:
        """As `generate`, with each reply's text as vLLM's detokenizer gives it (what its server returns)."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import StructuredOutputsParams

        structured = StructuredOutputsParams(regex=regex) if regex else None
        params = SamplingParams.from_optional(**{"max_tokens": max_tokens, "temperature": 0.0,
                                                 "ignore_eos": regex is None, "structured_outputs": structured,
                                                 **(sampling or {})})
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outputs]

    def choices(self, prompt: list[int], max_tokens: int, sampling: dict[str, Any]) -> list[list[int]]:
        """Every choice's token ids of one request (`sampling` with vLLM's `n`, `seed`, ...)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams.from_optional(**{"max_tokens": max_tokens, "ignore_eos": True, **sampling})
        output = self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        return [list(choice.token_ids) for choice in sorted(output.outputs, key=lambda c: c.index)]

    def logprobs(self, prompt: list[int], max_tokens: int, top: int) -> list[dict[str, float]]:
        """Greedy, ignore_eos: each generated token's candidates (the sampled one and the `top`
        likeliest) by their text, as vLLM's server names them, with their log probabilities."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=top)
        output = self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
        return [{p.decoded_token: p.logprob for p in step.values()} for step in output.logprobs]


def start_reference(config) -> "ray.actor.ActorHandle":
    """The decode engines' arguments (dtype, quantization, ...) but vLLM's own scheduling limits,
    which suit its offline batches and change no token."""
    kwargs = {key: value for key, value in config.engine_kwargs_of("decode").items() if key not in SCHEDULER_ARGS}
    return ReferenceEngine.remote(str(config.model_path()), {**kwargs, "block_size": config.block_size,
                                                             "max_model_len": config.max_model_len})
