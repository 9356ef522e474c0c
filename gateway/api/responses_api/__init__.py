"""POST /v1/responses: OpenAI's Responses API for text, served by the chat path (no second pipeline).

    protocol.py  the request (pydantic, validated at the edge) and the fields it refuses;
    mapping.py   the request → a ChatCompletionRequest (instructions and input items → messages, tools,
                 tool_choice, text.format → response_format), and a chat 400 back in the request's names;
    objects.py   the response object, its output items and the stream's typed events;
    writer.py    one response's output as the chat path's deltas arrive: items, events, the final object;
    routes.py    the route: prepare as chat, admit, stream through both stages, answer whole or as SSE.
Nothing is stored (store: false): a request that needs server-side state is a 400 saying so.
"""
