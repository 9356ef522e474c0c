"""A conversation through the model's chat template: the token ids, or a 400 naming what the template refused
(gateway/api/prepare.py calls this, in its worker thread when the conversation is long)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from gateway.api.bad_request import BadRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], add_generation_prompt: bool,
           continue_final_message: bool, template_kwargs: dict[str, Any], extra: dict[str, Any]) -> list[int]:
    """The token ids of `messages` rendered with `extra` (tools) and the request's `template_kwargs`
    (vLLM's chat_template_kwargs) as template variables.

    Raises:
        BadRequest: the template refuses the messages, cannot continue the last one, or fails on the
            request's own variables.
    """
    try:
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True,
            continue_final_message=continue_final_message, **template_kwargs, **extra)
    except TemplateError as exc:  # the template refuses the conversation (e.g. roles that must alternate)
        raise BadRequest(f"the model's chat template refuses these messages: {exc.message}",
                         param="messages") from None
    except ValueError as exc:  # transformers: a final message continue_final_message cannot find
        raise BadRequest(f"continue_final_message: {exc}", param="continue_final_message") from None
    except (TypeError, AttributeError, KeyError) as exc:  # a template given variables it cannot use
        if not template_kwargs:
            raise
        raise BadRequest(f"the model's chat template fails with these chat_template_kwargs: {exc}",
                         param="chat_template_kwargs") from None
    # transformers 5 returns a BatchEncoding here; older versions a plain list.
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)  # type: ignore[call-overload,index,arg-type]
