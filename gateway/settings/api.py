"""The OpenAI API's model-side defaults: max_tokens, tool calls, reasoning, the chat template and the
generation config."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from gateway.api.chat_template import load_chat_template
from gateway.api.sampling_defaults import check_generation_config


class ApiSettings(BaseModel):
    default_max_tokens: int | None = Field(
        None, ge=1,
        description="max_tokens of chat requests that give none (default: as vLLM, the model's "
                    "generation_config.json max_new_tokens, else all the context the prompt leaves)")
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = Field(
        "auto",
        description="how the model writes tool calls: hermes (<tool_call> JSON: Qwen2, Hermes, ChatML), "
                    "llama3_json, or auto (detected from the chat template)")
    # Reasoning models and the model's own files (gateway/api/reasoning.py, chat_template.py,
    # sampling_defaults.py).
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        None,
        description="split a thinking model's <think>...</think> off the answer into message.reasoning "
                    "(and reasoning_content), streamed too: qwen3 (follows chat_template_kwargs "
                    "enable_thinking) or deepseek_r1 (the output starts inside the reasoning) "
                    "(default: none, the thinking stays in content)")
    chat_template: str | None = Field(
        None,
        description="a Jinja chat template replacing the tokenizer's: a file, or the template's text "
                    "(default: the model's own)")
    max_logprobs: int = Field(
        20, ge=0, le=20,
        description="the most alternatives per token a request may ask for (top_logprobs, completions' "
                    "logprobs, prompt_logprobs; more is a 400), as vLLM's flag; 0: only the chosen tokens' "
                    "own logprobs")
    enable_prompt_tokens_details: bool = Field(
        False,
        description="responses carry the prompt tokens served from the prefix cache (usage's "
                    "prompt_tokens_details.cached_tokens, timings' cached_tokens and local_prefill_reason), "
                    "as vLLM's flag: off by default, since the count tells one client whether another's "
                    "prompt is cached (cache_salt keeps tenants apart)")
    generation_config: str = Field(
        "auto",
        description="sampling defaults for the fields a request leaves unset: auto (the model's "
                    "generation_config.json, as vLLM), vllm (ignore it: temperature 1, top_p 1) or a "
                    "directory holding a generation_config.json (its max_new_tokens then caps every "
                    "request)")

    @field_validator("chat_template")
    @classmethod
    def _chat_template_loads(cls, template: str | None) -> str | None:
        if template is not None:
            load_chat_template(template)
        return template

    @field_validator("generation_config")
    @classmethod
    def _generation_config_exists(cls, source: str) -> str:
        return check_generation_config(source)
