"""The routes around generation that clients and benchmark tools use (all behind the API key):

GET  /v1/models    the one model served: id, root (the model as --model gave it), max_model_len, owned_by
POST /tokenize     {"prompt": text} or {"messages": [...]} → {"tokens", "count", "max_model_len"} (the chat
                   template applied as for /v1/chat/completions); vLLM's shape, which `vllm bench serve` reads
POST /detokenize   {"tokens": [ids]} → {"prompt": text}
GET  /version      {"version": pdserve's}
Long text and many ids are (de)tokenized in gateway/api/prepare.py's worker thread, as a request's prompt is,
so that the event loop keeps streaming; more than a long context's worth of either is refused (400).
"""

from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from gateway.api.auth import require_api_key
from gateway.api.bad_request import BadRequest
from gateway.api.errors import documented
from gateway.api.prepare import Preparer
from gateway.api.protocol import ChatMessage, Text

router = APIRouter(dependencies=[Depends(require_api_key)])

# A long context's worth (256k tokens, at ~4 characters each): more is only work for the gateway.
MAX_TOKENIZE_CHARS = 1 << 20  # of the prompt, or of the messages' content together
MAX_DETOKENIZE_IDS = 1 << 18


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: Text | None = None  # plain text, tokenized as /v1/completions does
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)  # rendered as chat does
    add_generation_prompt: bool = True  # with messages: end with the assistant's turn opening
    # The tokenizer's special tokens (e.g. BOS) around the text, as vLLM: None means yes for a prompt, no for
    # messages (the chat template writes its own); yes for messages adds them on top of the template's.
    add_special_tokens: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


def _preparer(request: Request, model: str | None) -> Preparer:
    preparer: Preparer = request.app.state.preparer
    if model is not None:
        preparer.check_model(model)
    return preparer


@router.get("/v1/models", responses=documented(401))
async def models(request: Request) -> dict[str, object]:
    preparer: Preparer = request.app.state.preparer
    return {"object": "list", "data": [{
        "id": preparer.model_name, "object": "model", "created": int(request.app.state.started),
        "owned_by": "pdserve", "root": request.app.state.model_root, "parent": None,
        "max_model_len": preparer.spec.max_model_len,
    }]}


@router.post("/tokenize", responses=documented(400, 401, 404))
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, object]:
    preparer = _preparer(request, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("give exactly one of prompt and messages", param="prompt")
    if body.prompt is not None:
        _check_size("prompt", len(body.prompt))
        tokens = await preparer.encode(body.prompt, body.add_special_tokens is not False)
    else:
        assert body.messages is not None
        _check_size("messages", sum(len(m.text) for m in body.messages))
        tokens = await preparer.render_chat(body.messages, body.add_generation_prompt)
        if body.add_special_tokens:  # the rendered text, tokenized again with the special tokens
            tokens = await preparer.encode(await preparer.decode(tokens), add_special_tokens=True)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": preparer.spec.max_model_len}


@router.post("/detokenize", responses=documented(400, 401, 404))
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, object]:
    preparer = _preparer(request, body.model)
    if len(body.tokens) > MAX_DETOKENIZE_IDS:
        raise BadRequest(f"at most {MAX_DETOKENIZE_IDS} token ids can be detokenized, got "
                         f"{len(body.tokens)}", param="tokens")
    bad = [t for t in body.tokens if not 0 <= t < preparer.spec.vocab_size]
    if bad:
        raise BadRequest(f"token ids outside the vocabulary [0, {preparer.spec.vocab_size}): {bad[:5]}",
                         param="tokens")
    return {"prompt": await preparer.decode(body.tokens)}


def _check_size(param: str, num_chars: int) -> None:
    if num_chars > MAX_TOKENIZE_CHARS:
        raise BadRequest(f"at most {MAX_TOKENIZE_CHARS} characters can be tokenized, got {num_chars}",
                         param=param)


@router.get("/version", responses=documented(401))
async def version() -> dict[str, str]:
    try:
        return {"version": metadata.version("pdserve")}
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return {"version": "unknown"}
