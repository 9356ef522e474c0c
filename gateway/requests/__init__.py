"""One request's way through the prefill and decode stages: admission, routing, deadlines, the stream back."""
