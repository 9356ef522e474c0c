"""vLLM's request extensions at their default values: a request carrying them all must be served exactly as
one without them (tests/gateway/test_extension_units.py, tests/gateway/test_vllm_extensions.py)."""

from __future__ import annotations

from typing import Any

DEFAULTS: dict[str, Any] = {
    "min_p": 0.0, "top_k": -1, "bad_words": [], "allowed_token_ids": None, "prompt_logprobs": None,
    "truncate_prompt_tokens": None, "skip_special_tokens": True, "include_stop_str_in_output": False,
    "return_tokens_as_token_ids": False, "structured_outputs": None, "priority": 0,
}
CHAT_DEFAULTS: dict[str, Any] = {"add_generation_prompt": True, "continue_final_message": False,
                                 "chat_template_kwargs": {}, "echo": False}
